"""What a checkpoint stores, from its safetensors headers only (never the tensors).

- A local directory with `*.safetensors` files (or `model.safetensors.index.json` naming the shards): each
  file's header is read with the safetensors library (`safe_open(...).get_slice(name)`: shape and dtype, no
  data loaded).
- A Hub id, when online: `huggingface_hub.get_safetensors_metadata` fetches the headers only (HTTP range
  requests), never the weights.

The element count is cross-checked against the built model's parameters. The stored dtype is information,
and the precision only where `precision_for` says so: with `--precision stored`, or for a local directory
without `--precision`. A Hub id never takes it by default, so the default does not depend on the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError, UsageError
from ..report.sections import CheckpointCheck
from ..spec import Mode, Precision, RunSpec

# safetensors dtype codes (safetensors' Rust `Dtype`) -> torch dtype names
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}
# a stored floating dtype -> the precision that keeps the weights in it
PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True, slots=True)
class CheckpointHeader:
    """Elements per stored dtype over every tensor of a checkpoint. `source`: 'local safetensors' or 'hub'."""

    files: int
    elements_by_dtype: tuple[tuple[str, int], ...]  # (torch dtype name, elements), most elements first
    source: str

    @property
    def elements(self) -> int:
        return sum(n for _, n in self.elements_by_dtype)

    @property
    def dtype(self) -> str:
        """The dtype holding the most elements (the weights' dtype)."""
        return self.elements_by_dtype[0][0]


def _header(counts: dict[str, int], files: int, source: str) -> CheckpointHeader | None:
    if not counts:
        return None
    return CheckpointHeader(files, tuple(sorted(counts.items(), key=lambda kv: -kv[1])), source)


def local_header(directory: Path) -> CheckpointHeader | None:
    """The safetensors headers of `directory` (None without safetensors files). Raises ModelLoadError for a
    file that is not safetensors or a shard the index names but the directory lacks."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index (no weight_map): {e}") from e
        files = [directory / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that {directory} lacks: {', '.join(missing[:3])}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    dtype = _DTYPES.get(sl.get_dtype(), sl.get_dtype().lower())
                    counts[dtype] = counts.get(dtype, 0) + n
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"cannot read the safetensors header of {f}: {e}") from e
    return _header(counts, len(files), "local safetensors")


def hub_header(repo_id: str, timeout_s: float | None = None) -> CheckpointHeader | None:
    """The Hub repo's safetensors headers through `huggingface_hub.get_safetensors_metadata` (each request
    bounded by `timeout_s` seconds), or None when offline (`huggingface_hub.constants.is_offline_mode()`),
    unreachable, gated, or the repo has no safetensors: the config alone still answers, and the header is
    information only (`precision_for`)."""
    import huggingface_hub
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return None
    try:
        meta = huggingface_hub.get_safetensors_metadata(repo_id, timeout=timeout_s)
    except Exception:  # no safetensors, gated, unreachable: the config alone still answers
        return None
    counts = {_DTYPES.get(k, k.lower()): int(v) for k, v in meta.parameter_count.items()}
    return _header(counts, len(meta.files_metadata), "hub")


def cross_check(header: CheckpointHeader, params: int) -> CheckpointCheck:
    """The report's `model.checkpoint` entry: what is stored against the built model's parameter count."""
    diff = header.elements - params
    note = "matches the built model" if diff == 0 else (
        f"MISMATCH: the checkpoint holds {header.elements:,} elements, the model built from the config has "
        f"{params:,} parameters ({diff:+,}); the config may not belong to these weights, or the checkpoint "
        "stores extra buffers")
    return CheckpointCheck(source=header.source, files=header.files, elements=header.elements,
                           dtypes=dict(header.elements_by_dtype), matches=diff == 0, note=note)


def precision_for(spec: RunSpec, resolved) -> tuple[Precision, str]:
    """The precision to build `spec`'s model with, and where it came from (the report's `run.precision_source`).
    `resolved` is the `loading.ResolvedConfig` of `spec.model`; its `checkpoint` header, if any, is read here.

    - `--precision fp32|bf16|fp16|bf16-mixed|fp16-mixed|bf16-autocast|fp16-autocast`: as given (or as a `--from`
      file sets it, `spec.sources`).
    - `--precision stored`: pure precision in the checkpoint's stored dtype (the dtype holding the most elements
      of its safetensors headers: a local directory's files, or a Hub repo's when the Hub answers).
    - no `--precision`, a local directory with safetensors: the stored dtype (the weights as they are on disk).
    - no `--precision` with `--recipe`: bf16-autocast (the weights in bf16 as the recipes load them, HF Trainer's
      bf16=True: axolotl's `bf16: auto` on a bf16 GPU, LLaMA-Factory's examples' `bf16: true`).
    - otherwise, Hub ids included: the mode's default (bf16-mixed to train, bf16 for inference), whether or not
      the Hub could be reached; a Hub checkpoint's stored dtype is only named in the source.

    Raises UsageError for `--precision stored` without a header (bundled id, custom module, offline, no
    safetensors) or with a stored dtype that is not fp32, bf16 or fp16.
    """
    header = resolved.checkpoint
    if spec.precision is Precision.STORED:
        if header is None:
            why = {"bundled": f"the bundled id {resolved.ref!r} comes with a config only",
                   "custom": "a custom module has no checkpoint",
                   "hub": f"no safetensors headers of Hub repo {resolved.ref!r} are available (offline, unreachable, "
                          "or the repo has no safetensors)"}.get(resolved.source,
                                                                  f"{resolved.location} has no *.safetensors beside it")
            raise UsageError(f"--precision stored needs the checkpoint's safetensors headers, but {why}; pass a "
                             "local directory holding config.json and the *.safetensors, or choose --precision "
                             "fp32|bf16|fp16|bf16-mixed|fp16-mixed")
        if header.dtype not in PRECISION_OF_DTYPE:
            raise UsageError(f"--precision stored: the checkpoint stores {header.dtype}, which is not a precision "
                             "vramtrace models (fp32, bf16, fp16); choose --precision explicitly")
        return (Precision(PRECISION_OF_DTYPE[header.dtype]),
                f"--precision stored: the {header.source} checkpoint stores {header.dtype}")
    if spec.precision is not None:
        given = [e for e in spec.sources if e.option == "precision"]  # set by a --from file (vramtrace.sources)
        return spec.precision, f"--from {given[-1].file} ({given[-1].key})" if given else "--precision"
    if spec.recipe is not None:  # axolotl's bf16 "auto" on a bf16 GPU, LLaMA-Factory's examples' bf16: true
        return Precision.BF16_AUTOCAST, f"default for --recipe {spec.recipe.value}"
    if resolved.source == "local" and header is not None and header.dtype in PRECISION_OF_DTYPE:
        return (Precision(PRECISION_OF_DTYPE[header.dtype]),
                f"the {header.source} checkpoint stores {header.dtype} (local directory, no --precision)")
    default = Precision.BF16_MIXED if spec.mode is Mode.TRAIN else Precision.BF16
    stored = f" (the {header.source} checkpoint stores {header.dtype}; --precision stored uses it)" if header else ""
    return default, f"default for {spec.mode.value}{stored}"
