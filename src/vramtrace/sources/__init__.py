"""Training config files as RunSpec fields (issue 41): axolotl and LLaMA-Factory YAMLs, transformers'
TrainingArguments JSON, accelerate config YAMLs. `read_source(path)` reads one (its format detected from its
content), `merge_sources` merges several with the command line's options, `spec_from(*paths, **overrides)` makes
the RunSpec (the Python API of `vramtrace --from FILE`). Torch-free.

Keys: each format's reader (`axolotl.py`, `llamafactory.py`, `training_args.py`, `accelerate.py`) reads the keys
that set a RunSpec field, citing the project's file and function for every default; keys that change memory and
that vramtrace does not model are warnings (`Source.warnings`, the report's `run.warnings`); keys known to leave
one training step's memory alone (data, logging, saving, evaluation, schedules) are ignored; any other key is a
warning too, since vramtrace cannot tell whether it changes memory."""

from .base import Source, SourceEntry, SourceFormat, Target
from .reader import FORMATS_TEXT, detect, merge_sources, read_source, spec_from, target_of

__all__ = ["FORMATS_TEXT", "Source", "SourceEntry", "SourceFormat", "Target", "detect", "merge_sources",
           "read_source", "spec_from", "target_of"]
