"""The report's typed data: its sections as frozen dataclasses (`sections`), one serializer and one deserializer
for every dataclass of the report (`data`), and the JSON Schema generated from them (`schema`). Torch-free."""
