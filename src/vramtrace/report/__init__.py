"""The report: `MemoryReport` and `summarize` (`summary`: from the timelines to the report), its sections as frozen
dataclasses (`sections`), one serializer and one deserializer for every dataclass of the report (`data`), and the
JSON Schema generated from them (`schema`). Torch-free; it imports no renderer (those are in `vramtrace.render`)."""
