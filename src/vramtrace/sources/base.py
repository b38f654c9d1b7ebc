"""The types of `vramtrace.sources` and the helpers its format readers share. Torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping


class SourceFormat(str, enum.Enum):
    """The file formats `read_source` understands (the value is what the report and messages call them)."""

    AXOLOTL = "axolotl"  # an axolotl 0.21 training YAML (`axolotl train config.yml`)
    LLAMAFACTORY = "llamafactory"  # a LLaMA-Factory 0.9.5 training YAML (`llamafactory-cli train config.yaml`)
    TRAINING_ARGUMENTS = "training-arguments"  # transformers' TrainingArguments as JSON (`args.to_json_string()`)
    ACCELERATE = "accelerate"  # an accelerate 1.15 config YAML (`accelerate config`, `accelerate launch --config_file`)
    DEEPSPEED = "deepspeed"  # a DeepSpeed config JSON (ds_config.json: `--deepspeed FILE`, sources/deepspeed.py)


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """One RunSpec field set by a file. option: the RunSpec field's name (`batch`, `seq`, ...); value: what it is
    set to, as RunSpec takes it (an int, a str, a tuple of str, a bool); file: the file's name (no directory); key: the
    file's key(s) it came from, `+`-joined when several decide it (`adapter+load_in_4bit`), with ` (default)` when
    the key is absent and the project's default decides."""

    option: str
    value: Any
    file: str
    key: str


@dataclass(frozen=True, slots=True)
class Source:
    """One file read by `read_source`. path: as given; format: the detected `SourceFormat`; model: the model it
    names (axolotl `base_model`, LLaMA-Factory `model_name_or_path`), None for formats that hold none; settings:
    the RunSpec fields it sets, in reading order; warnings: one line per key that changes memory and that
    vramtrace does not model (the prediction is made without it); warning_fields: for each warning, the RunSpec
    field that, given on the command line, makes it moot (None: none does); launch_env: the environment an
    accelerate config makes `accelerate launch` export that another file's project reads (`FSDP_VERSION`)."""

    path: str
    format: SourceFormat
    model: str | None
    settings: tuple[SourceEntry, ...]
    warnings: tuple[str, ...]
    warning_fields: tuple[str | None, ...] = ()
    launch_env: tuple[tuple[str, str], ...] = ()


@dataclass
class Reading:
    """What a format reader collects while it reads one mapping: `set` adds a RunSpec field, `warn` a warning
    line. `used` holds every key read (`key`), the rest is checked by `check_rest`."""

    file: str
    data: Mapping[str, Any]
    entries: list[SourceEntry] = field(default_factory=list)
    warnings: list[tuple[str, str | None]] = field(default_factory=list)
    used: set[str] = field(default_factory=set)
    launch_env: dict[str, str] = field(default_factory=dict)
    last: str = ""  # the key read last: a value of the wrong type is reported under it (reader.read_source)

    def get(self, key: str, default: Any = None) -> Any:
        """The file's value of `key` (None in the file counts as absent), marking it read."""
        self.used.add(key)
        self.last = key
        value = self.data.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        """Whether the file gives `key` a value (not null), marking it read."""
        self.used.add(key)
        self.last = key
        return self.data.get(key) is not None

    def mark(self, *keys: str) -> None:
        """Mark `keys` as read (their meaning is covered by another key's reading)."""
        self.used.update(keys)

    def set(self, option: str, value: Any, *keys: str) -> None:
        """Set RunSpec's `option` to `value`, from the file's `keys` (the absent ones marked ` (default)`; a
        dotted key, `fsdp_config.fsdp_offload_params`, names a nested one and is taken as present)."""
        named = "+".join(k if "." in k or self.data.get(k) is not None else f"{k} (default)" for k in keys)
        self.entries = [e for e in self.entries if e.option != option]  # a later reading of the file wins
        self.entries.append(SourceEntry(option, value, self.file, named))

    def warn(self, key: str, text: str, field: str | None = None) -> None:
        """One warning line, `FILE: KEY: text`; `field`: the RunSpec field that, given on the command line, makes
        it moot."""
        self.warnings.append((f"{self.file}: {key}: {text}", field))

    def check_rest(self, harmless: frozenset[str], warned: Mapping[str, Any], project: str) -> None:
        """Every key not read yet: a key of `warned` (key -> the project's default) whose value is not the
        default gets a warning (it changes memory and vramtrace does not model it); a key of `harmless` (learning
        rates, data, logging, saving, evaluation: no effect on one training step's memory) is ignored; any other
        key gets a warning, since vramtrace cannot tell whether it changes memory."""
        for key, value in self.data.items():
            if key in self.used or key in harmless or value is None:
                continue
            if key in warned:
                if value != warned[key]:
                    self.warn(key, f"{value!r} changes memory and is not modelled by vramtrace yet; the prediction "
                                   "is made without it")
                continue
            self.warn(key, f"not a key vramtrace's {project} reader knows; if it changes memory, the prediction "
                           "does not include it")


@dataclass(frozen=True, slots=True)
class Target:
    """What a reader needs to know of the target to resolve a file's "auto" values: cuda (a CUDA device, not
    `--device cpu`) and bf16 (the GPU supports bf16: sm80 and later, transformers'
    `is_torch_bf16_gpu_available()`)."""

    cuda: bool = True
    bf16: bool = True


DEEPSPEED_WARNING = ("the DeepSpeed config it names is not read from here: pass it as --deepspeed FILE with --dp N "
                     "(docs/zero.md); the prediction is for one GPU without ZeRO")


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple
