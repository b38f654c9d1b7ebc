"""Resolve a model reference to a transformers config, offline-first, never downloading weights.

Resolution order:
0. a custom module `path/to/model.py:NAME` or `package.module:NAME` (source 'custom', built by `custom.py`);
1. a local path: a directory holding `config.json` (or Meta's `params.json`), or a path to such a file; a
   directory's safetensors headers are read too (`checkpoint_headers.py`);
2. a bundled id (`configs/index.json`): answers at once, offline, with no network call;
3. a Hub id: only `config.json` (else `params.json`) through `huggingface_hub.hf_hub_download`, which honours
   `HF_HUB_OFFLINE` and the HF cache; online, also the safetensors headers (`get_safetensors_metadata`).
A config with `auto_map` (remote code) is refused unless `trust_remote_code` is set; none of its code is run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from ..spec import custom_ref
from .checkpoint_headers import hub_header, local_header

_CONFIG_DIR = resources.files("vramtrace.tracer") / "configs"


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """A config dict and where it came from (`source`: 'bundled', 'local', 'hub')."""

    ref: str
    config: dict[str, Any]
    source: str
    location: str
    checkpoint: Any = None  # checkpoint_headers.CheckpointHeader of the weights beside the config, if any


def bundled_ids() -> dict[str, str]:
    """Map of bundled model ids to their config file names."""
    return json.loads((_CONFIG_DIR / "index.json").read_text())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from e
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def meta_params_to_hf(params: dict[str, Any]) -> dict[str, Any]:
    """Convert Meta's Llama `params.json` to a transformers LlamaConfig dict.

    Mirrors transformers' `models/llama/convert_llama_weights_to_hf.py` (`compute_intermediate_size`):
    intermediate = multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) / multiple_of).
    A `vocab_size` of -1 (Llama 2) means the 32,000-token SentencePiece vocabulary.
    """
    try:
        dim, n_layers, n_heads = int(params["dim"]), int(params["n_layers"]), int(params["n_heads"])
    except KeyError as e:
        raise ModelLoadError(f"params.json lacks {e.args[0]!r}; it does not look like a Meta Llama params.json") from e
    multiple_of = int(params.get("multiple_of", 256))
    mult = float(params.get("ffn_dim_multiplier") or 1.0)
    inter = multiple_of * math.ceil(int(mult * int(8 * dim / 3)) / multiple_of)
    vocab = int(params.get("vocab_size", -1))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(params.get("n_kv_heads") or n_heads),
        "vocab_size": vocab if vocab > 0 else 32000,
        "rms_norm_eps": float(params.get("norm_eps", 1e-5)),
        "rope_theta": float(params.get("rope_theta", 10000.0)),
        "max_position_embeddings": 4096 if vocab <= 0 else 8192,
        "tie_word_embeddings": False,
    }
    if params.get("use_scaled_rope"):
        cfg["rope_scaling"] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        cfg["max_position_embeddings"] = 131072
    return cfg


def _from_file(path: Path, ref: str, source: str) -> ResolvedConfig:
    data = _read_json(path)
    if path.name == "params.json" and "model_type" not in data:
        data = meta_params_to_hf(data)
    return ResolvedConfig(ref=ref, config=data, source=source, location=str(path))


def _local(ref: str) -> ResolvedConfig | None:
    p = Path(ref).expanduser()
    looks_like_path = ref.startswith((".", "/", "~")) or ref.endswith(".json") or os.sep in ref and p.exists()
    if p.is_dir():
        for name in ("config.json", "params.json"):
            if (p / name).is_file():
                resolved = _from_file(p / name, ref, "local")
                return replace(resolved, checkpoint=local_header(p))
        raise ModelLoadError(f"directory {ref} holds no config.json; pass a directory with a config.json or the file itself")
    if p.is_file():
        return _from_file(p, ref, "local")
    if looks_like_path and not p.exists():
        raise ModelLoadError(f"path {ref} does not exist; pass a directory holding config.json, a config.json, or a Hub id")
    return None


def _bundled(ref: str) -> ResolvedConfig | None:
    index = {k.lower(): v for k, v in bundled_ids().items()}
    name = index.get(ref.lower())
    if name is None:
        return None
    return ResolvedConfig(ref=ref, config=json.loads((_CONFIG_DIR / name).read_text()),
                          source="bundled", location=f"vramtrace/tracer/configs/{name}")


def _hub(ref: str) -> ResolvedConfig:
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    hint = "pass a local directory holding config.json (or the path to a config.json)"
    last: Exception | None = None
    for filename in ("config.json", "params.json"):
        try:
            path = huggingface_hub.hf_hub_download(ref, filename)
        except hf_errors.GatedRepoError as e:
            raise ModelLoadError(f"Hub repo {ref!r} is gated: run `hf auth login` after accepting its licence, or {hint}") from e
        except hf_errors.RepositoryNotFoundError as e:
            raise ModelLoadError(f"no Hub repo {ref!r} (or it is private): check the id, or {hint}") from e
        except hf_errors.HFValidationError as e:
            raise ModelLoadError(f"{ref!r} is neither an existing path nor a valid Hub id; {hint}") from e
        except hf_errors.EntryNotFoundError as e:
            last = e
            continue
        except (hf_errors.LocalEntryNotFoundError, OSError) as e:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            why = "HF_HUB_OFFLINE is set and it is not in the HF cache" if offline else "the Hub cannot be reached and it is not in the HF cache"
            raise ModelLoadError(f"cannot fetch the config of {ref!r}: {why}; {hint}") from e
        return replace(_from_file(Path(path), ref, "hub"), checkpoint=hub_header(ref))
    raise ModelLoadError(f"Hub repo {ref!r} has neither config.json nor params.json; {hint}") from last


def resolve_config(ref: str) -> ResolvedConfig:
    """Resolve `ref` (local path, bundled id or Hub id) to a config dict. Raises ModelLoadError."""
    if not ref or not ref.strip():
        raise ModelLoadError("empty model reference; pass a Hub id, a bundled id or a path to a config.json")
    custom = custom_ref(ref)
    if custom is not None:
        return ResolvedConfig(ref=ref, config={}, source="custom", location=custom[0])
    return _local(ref) or _bundled(ref) or _hub(ref)
