"""Resolve a model reference to a transformers config, offline-first, never downloading weights.

Resolution order:
0. a custom module `path/to/model.py:NAME` or `package.module:NAME` (source 'custom', built by `custom.py`);
1. a local path: a directory holding `config.json` (or Meta's `params.json`), or a path to such a file; a
   directory's safetensors headers are read too (`checkpoint_headers.py`);
2. a bundled id (`configs/index.json`): answers at once, offline, with no network call;
3. a Hub id: only `config.json` (else `params.json`) through `huggingface_hub.hf_hub_download`; offline
   (`HF_HUB_OFFLINE`) from the HF cache only; online after a probe bounded by `HUB_TIMEOUT_S`, and also the
   safetensors headers (`get_safetensors_metadata`), as information (`checkpoint_headers.precision_for`).
A config with `auto_map` (remote code) is refused unless `trust_remote_code` is set; none of its code is run.
Every config file is read as `transformers.AutoConfig.from_pretrained` reads it (`_read_config`), never as raw JSON.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from ..custom_inputs import IN_PROCESS_LOCATION, InProcessModel, custom_ref
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


def bundled_models() -> list[tuple[str, str]]:
    """(bundled id, its config's model_type), sorted by id without regard to case: `vramtrace models`."""
    return [(ref, _bundled_config(name).get("model_type", "?"))
            for ref, name in sorted(bundled_ids().items(), key=lambda kv: kv[0].lower())]


def _read_config(path: Path) -> dict[str, Any]:
    """The config dict of the JSON file at `path`, read by `transformers.PretrainedConfig.get_config_dict`, the
    reader `AutoConfig.from_pretrained` uses (transformers/configuration_utils.py `_dict_from_json_file`): it
    decodes transformers' own encoding of non-finite floats (`{"__float__": "Infinity"}`, written by
    `save_pretrained`'s `_encode_special_floats`, e.g. Mamba2's `time_step_limit`). A file path is read locally,
    with no Hub call (`resolve_revision` and `_get_config_dict` take an existing path as it is).
    Raises ModelLoadError (unreadable, not JSON, not a JSON object)."""
    from transformers import PretrainedConfig

    try:
        path.read_bytes()  # an unreadable file: our one line, not transformers' message about the Hub
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from e
    try:
        data = PretrainedConfig.get_config_dict(str(path))[0]
    except (OSError, AttributeError, TypeError) as e:  # not JSON; or JSON that is not an object
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError as bad:
            raise ModelLoadError(f"{path} is not valid JSON ({bad.msg} at line {bad.lineno}); fix or re-download "
                                 "it") from e
        raise ModelLoadError(f"{path} must hold a JSON object: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _bundled_config(name: str) -> dict[str, Any]:
    """The bundled config file `name` (configs/), read by `_read_config`."""
    with resources.as_file(_CONFIG_DIR / name) as path:
        return _read_config(Path(path))


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
    data = _read_config(path)
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
    return ResolvedConfig(ref=ref, config=_bundled_config(name),
                          source="bundled", location=f"vramtrace/tracer/configs/{name}")


# Seconds the Hub may take to answer the probe of a config file before it counts as unreachable, a wall-clock
# deadline over everything the probe does (huggingface_hub also fetches its agent registry, 3 s timeout, before
# the first request of a process): "unreachable" comes in about this time, not after huggingface_hub's
# retries (hf_hub_download retries a failed HEAD with a 60 s timeout and backoff when the file is not cached).
HUB_TIMEOUT_S = 3.0
_CONFIG_FILES = ("config.json", "params.json")


def close_bundled_ids(ref: str, n: int = 3) -> list[str]:
    """The bundled ids closest to `ref` (difflib, case-insensitive), best first; [] when none is close."""
    ids = sorted(bundled_ids())
    by_lower = {i.lower(): i for i in ids}
    close = difflib.get_close_matches(ref.lower(), list(by_lower), n=n, cutoff=0.6)
    if not close and "/" in ref:  # compare the names without the organisation: 'Llama-3-8B' vs 'Llama-3.1-8B'
        names = {i.rsplit("/", 1)[-1].lower(): i for i in ids}
        close = difflib.get_close_matches(ref.rsplit("/", 1)[-1].lower(), list(names), n=n, cutoff=0.6)
        return [names[c] for c in close]
    return [by_lower[c] for c in close]


def _not_reachable(ref: str, why: str, hint: str) -> ModelLoadError:
    close = close_bundled_ids(ref)
    mean = f"did you mean {' or '.join(close)}? " if close else ""
    return ModelLoadError(f"{ref!r} is not a bundled id and {why}; {mean}`vramtrace models` lists the bundled ids; "
                          f"or {hint}")


def _cached(ref: str) -> Path | None:
    """The cached config.json (else params.json) of Hub repo `ref` through
    `huggingface_hub.try_to_load_from_cache` (no network call, no HTTP headers built), or None."""
    import huggingface_hub

    for filename in _CONFIG_FILES:
        found = huggingface_hub.try_to_load_from_cache(ref, filename)
        if isinstance(found, str):  # else None (not cached) or the sentinel "known not to exist"
            return Path(found)
    return None


def _probe(url: str) -> None:
    """HEAD `url` through `huggingface_hub.get_hf_file_metadata` (no retries), in a daemon thread given
    HUB_TIMEOUT_S seconds in all. Raises what it raises (RemoteEntryNotFoundError, GatedRepoError, a transport
    error, ...), or TimeoutError when it has not answered by then."""
    import threading

    import huggingface_hub

    outcome: list = []

    def run() -> None:
        try:
            outcome.append(huggingface_hub.get_hf_file_metadata(url, timeout=HUB_TIMEOUT_S))
        except BaseException as e:  # handed to the caller's thread
            outcome.append(e)

    thread = threading.Thread(target=run, name="vramtrace-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    if not outcome:
        raise TimeoutError(f"no answer within {HUB_TIMEOUT_S:g} s")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]


def _hub(ref: str) -> ResolvedConfig:
    """Hub repo `ref`'s config.json (else params.json). Offline (`huggingface_hub.constants.is_offline_mode()`,
    i.e. HF_HUB_OFFLINE) only the HF cache is read; online a HEAD probe (`_probe`: at most HUB_TIMEOUT_S seconds,
    no retries) checks the file before it is fetched, and a Hub that cannot be reached falls back to the cache.
    Raises ModelLoadError (offline or unreachable and not cached, gated, not found, no config); an unreachable Hub
    answers in about HUB_TIMEOUT_S seconds."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.utils import httpx, validate_repo_id

    hint = "pass a local directory holding its config.json (or the path to a config.json)"
    try:
        validate_repo_id(ref)
    except hf_errors.HFValidationError as e:
        raise ModelLoadError(f"{ref!r} is neither an existing path, a bundled id nor a valid Hub id; {hint}") from e
    if constants.is_offline_mode():
        path = _cached(ref)
        if path is None:
            raise _not_reachable(ref, "HF_HUB_OFFLINE is set, and the HF cache does not hold it", hint)
        return _from_file(path, ref, "hub")  # offline: no safetensors headers
    last: Exception | None = None
    for filename in _CONFIG_FILES:
        try:
            _probe(huggingface_hub.hf_hub_url(ref, filename))
            path = huggingface_hub.hf_hub_download(ref, filename, etag_timeout=HUB_TIMEOUT_S)
        except hf_errors.GatedRepoError as e:
            raise ModelLoadError(f"Hub repo {ref!r} is gated: run `hf auth login` after accepting its licence, "
                                 f"or {hint}") from e
        except hf_errors.RepositoryNotFoundError as e:
            raise ModelLoadError(f"no Hub repo {ref!r} (or it is private): check the id, or {hint}") from e
        except hf_errors.RemoteEntryNotFoundError as e:
            last = e
            continue
        except (httpx.TransportError, TimeoutError, hf_errors.OfflineModeIsEnabled,
                hf_errors.LocalEntryNotFoundError) as e:
            path = _cached(ref)
            if path is None:
                text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise _not_reachable(ref, f"the Hub cannot be reached ({text[:100]}), and the HF cache does not "
                                     "hold it", hint) from e
            return _from_file(path, ref, "hub")
        except hf_errors.HfHubHTTPError as e:
            status = getattr(getattr(e, "response", None), "status_code", "?")
            raise ModelLoadError(f"the Hub answered HTTP {status} for {ref!r}/{filename}; retry later, or {hint}") from e
        return replace(_from_file(Path(path), ref, "hub"), checkpoint=hub_header(ref, HUB_TIMEOUT_S))
    raise ModelLoadError(f"Hub repo {ref!r} has neither config.json nor params.json; {hint}") from last


def resolve_config(ref: "str | InProcessModel") -> ResolvedConfig:
    """Resolve `ref` (local path, bundled id or Hub id) to a config dict; a custom module (a reference, or the
    `InProcessModel` of `analyze(model=<nn.Module>)`) has none. Raises ModelLoadError."""
    if isinstance(ref, InProcessModel):
        return ResolvedConfig(ref=str(ref), config={}, source="custom", location=IN_PROCESS_LOCATION)
    if not ref or not ref.strip():
        raise ModelLoadError("empty model reference; pass a Hub id, a bundled id or a path to a config.json")
    custom = custom_ref(ref)
    if custom is not None:
        return ResolvedConfig(ref=ref, config={}, source="custom", location=custom[0])
    return _local(ref) or _bundled(ref) or _hub(ref)
