"""Read a training config file (format detected from its content), merge several with the command line, and make
a RunSpec of them. Torch-free; YAML by PyYAML (a dependency of transformers, and of vramtrace)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import UsageError
from . import accelerate, axolotl, llamafactory, training_args
from .base import Reading, Source, SourceEntry, SourceFormat, Target

# keys only one format writes: how `detect` tells them apart (axolotl's and LLaMA-Factory's schemas, accelerate's
# `accelerate config` output, TrainingArguments' fields)
_MARKERS = {
    SourceFormat.DEEPSPEED: ("zero_optimization",),  # first: a ds_config also holds gradient_accumulation_steps
    SourceFormat.AXOLOTL: ("base_model", "micro_batch_size", "sequence_len", "adapter", "lora_r", "sample_packing",
                           "lora_target_linear"),
    SourceFormat.LLAMAFACTORY: ("model_name_or_path", "finetuning_type", "cutoff_len", "stage", "lora_rank",
                                "lora_target", "quantization_bit"),
    SourceFormat.ACCELERATE: ("distributed_type", "compute_environment", "num_processes", "mixed_precision"),
    SourceFormat.TRAINING_ARGUMENTS: ("per_device_train_batch_size", "gradient_accumulation_steps", "optim",
                                      "output_dir"),
}
FORMATS_TEXT = ("an axolotl YAML (base_model, micro_batch_size, sequence_len, ...), a LLaMA-Factory YAML "
                "(model_name_or_path, finetuning_type, cutoff_len, ...), a TrainingArguments JSON "
                "(per_device_train_batch_size, ...), an accelerate config YAML (distributed_type, fsdp_config, ...) or a "
                "DeepSpeed ds_config JSON (zero_optimization, ...)")


def detect(data: Mapping[str, Any], name: str) -> SourceFormat:
    """The format of a parsed file, from its keys: the first of axolotl, LLaMA-Factory, accelerate,
    TrainingArguments whose marker keys it holds (LLaMA-Factory files also hold TrainingArguments' keys, so the
    order matters). Raises UsageError naming the file and the formats understood."""
    for fmt, keys in _MARKERS.items():
        if any(k in data for k in keys):
            return fmt
    raise UsageError(f"cannot tell the format of --from {name}: it is none of {FORMATS_TEXT}")


def read_source(path: str | Path, target: Target = Target()) -> Source:
    """Read one training config file. `target` resolves the files' "auto" values (axolotl's `bf16: auto`, whether
    torch_compile can be traced). Raises UsageError for a file that cannot be read, is not a mapping, or is of no
    format `detect` knows, and for settings its own project refuses."""
    import yaml

    name = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --from {name}: {e.strerror}") from e
    try:
        data = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        raise UsageError(f"--from {name} is not valid YAML or JSON"
                         f"{f' (line {where.line + 1})' if where is not None else ''}") from e
    if not isinstance(data, dict):
        raise UsageError(f"--from {name} holds no mapping of keys; expected {FORMATS_TEXT}")
    fmt = detect(data, name)
    r = Reading(Path(name).name, data)
    model = None
    try:
        if fmt is SourceFormat.AXOLOTL:
            model = axolotl.read(r, target)
        elif fmt is SourceFormat.LLAMAFACTORY:
            model = llamafactory.read(r, target)
        elif fmt is SourceFormat.TRAINING_ARGUMENTS:
            training_args.read(r, target)
        elif fmt is SourceFormat.DEEPSPEED:  # the file as --deepspeed FILE (cli/from_files.py apply_deepspeed_config)
            r.set("deepspeed_config", str(Path(name).expanduser().resolve()), "zero_optimization")
        else:
            accelerate.read(r)
    except (ValueError, TypeError, AttributeError) as e:  # a value of the wrong type (int("abc"), a list for a dict)
        raise UsageError(f"--from {name}: {r.last}: {data.get(r.last)!r} is not a valid value for {fmt.value}'s "
                         f"{r.last} ({e})") from e
    return Source(name, fmt, None if model is None else str(model), tuple(r.entries),
                  tuple(line for line, _ in r.warnings), tuple(field for _, field in r.warnings),
                  tuple(r.launch_env.items()))


def merge_sources(sources: Iterable[Source], cli_given: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[
        SourceEntry, ...], tuple[str, ...]]:
    """The RunSpec keyword arguments of `sources`, the entries that decided them and the files' warnings: a later
    file overrides an earlier one field by field, and a field in `cli_given` (the options typed on the command
    line, or the keyword arguments of `spec_from`, with their values) overrides every file and is not listed as a
    source; a warning about a field in `cli_given` or set by another file is dropped (that decided it). The model is the
    last file's that names one, unless `cli_given` has `model`."""
    sources = list(sources)
    winners: dict[str, SourceEntry] = {}
    model: tuple[str, str, str] | None = None  # (model, file, key)
    for source in sources:
        for entry in source.settings:
            winners.pop(entry.option, None)  # re-inserted: the order of the last setting
            winners[entry.option] = entry
        if source.model is not None:
            key = "base_model" if source.format is SourceFormat.AXOLOTL else "model_name_or_path"
            model = (source.model, Path(source.path).name, key)
    _fsdp2_non_reentrant(sources, winners)
    kwargs = {option: entry.value for option, entry in winners.items() if option not in cli_given}
    entries = [entry for option, entry in winners.items() if option not in cli_given]
    if model is not None and "model" not in cli_given:
        kwargs["model"] = model[0]
        entries.insert(0, SourceEntry("model", *model))
    kwargs.update(cli_given)
    def moot(field: str | None, file: str) -> bool:  # decided by the command line or by another file
        return field in cli_given or (field in winners and winners[field].file != file)

    warnings = tuple(dict.fromkeys(line for s in sources for line, field in zip(s.warnings, s.warning_fields)
                                   if not moot(field, Path(s.path).name)))
    return kwargs, tuple(entries), warnings


def _fsdp2_non_reentrant(sources: list[Source], winners: dict[str, SourceEntry]) -> None:
    """LLaMA-Factory forces `use_reentrant_gc` False under an accelerate FSDP2 launch (model/model_utils/
    checkpointing.py:160-176, `ACCELERATE_USE_FSDP` and `FSDP_VERSION=2`): its `layers:reentrant` becomes
    `layers` when an accelerate file launches FSDP2."""
    ckpt = winners.get("checkpointing")
    lf_files = {Path(s.path).name for s in sources if s.format is SourceFormat.LLAMAFACTORY}
    fsdp2 = [s for s in sources if dict(s.launch_env).get("FSDP_VERSION") == "2"]
    if ckpt is not None and ckpt.file in lf_files and ckpt.value == "layers:reentrant" and fsdp2:
        winners["checkpointing"] = SourceEntry("checkpointing", "layers", ckpt.file,
                                               f"{ckpt.key}+{Path(fsdp2[-1].path).name}:fsdp_version")


def target_of(device: str = "cuda", gpu: str = "H100-80GB") -> Target:
    """The `Target` of RunSpec's `device` and `gpu`: bf16 on a CUDA GPU of sm80 or later (transformers'
    `is_torch_bf16_gpu_available`, which is False on a machine without CUDA)."""
    from ..gpus import parse_gpu

    cuda = str(getattr(device, "value", device)).lower() == "cuda"
    return Target(cuda=cuda, bf16=cuda and parse_gpu(gpu).sm >= 80)


def spec_from(*paths: str | Path, **overrides: Any):
    """A RunSpec from training config files (`read_source`, merged by `merge_sources`), `overrides` being RunSpec
    fields that beat the files (`spec_from("qlora.yml", batch=1, device="cpu")`). The RunSpec's `sources` lists
    the fields the files set. Raises UsageError (SpecError) as `read_source` and RunSpec do, and when neither a
    file nor `overrides` names the model or the sequence length."""
    from ..spec import RunSpec

    target = target_of(overrides.get("device", "cuda"), overrides.get("gpu", "H100-80GB"))
    kwargs, entries, warnings = merge_sources([read_source(p, target) for p in paths], overrides)
    missing = [name for name in ("model", "seq") if name not in kwargs]
    if missing:
        raise UsageError(f"{' and '.join(missing)} not in {', '.join(map(str, paths))}: pass "
                         f"{' and '.join(f'{m}=...' for m in missing)}")
    kwargs.setdefault("batch", 1)
    return RunSpec(**kwargs, sources=entries, source_warnings=warnings)

