"""DeepSpeed ZeRO (`--zero`, issue 42) without a real run: the ds_config reader and its "auto" values, the spec's
checks, the one-line errors, the bridges' entry and exit. The per-rank peaks against real 2-process DeepSpeed runs
are tests/test_zero.py's (tests/zero_oracle.py).

The tests that enter DeepSpeed's code skip without deepspeed (the optional extra [deepspeed]); run them with a
Python that has it, e.g. `DS_ACCELERATOR=cpu /work/venv-ds/bin/python -m pytest tests/test_zero_unit.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vramtrace.errors import UsageError
from vramtrace.sources.deepspeed import (DEEPSPEED_DEFAULTS, bucket_sources, hidden_size, read_ds_config,
                                         resolve_auto)
from vramtrace.spec import RunSpec, ZeroOffload

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "fixtures" / "configs" / "tiny-llama-gqa.json")


def _write(tmp_path: Path, config, name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


# HF's own ZeRO-3 example (transformers docs, "deepspeed" page: ds_config_zero3.json), as users copy it
HF_ZERO3 = {
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_hf_zero3_example_is_read_and_its_auto_values_filled_as_hf_fills_them(tmp_path):
    ds = read_ds_config(_write(tmp_path, HF_ZERO3))
    assert (ds.stage, ds.offload_optimizer, ds.offload_param) == (3, "cpu", "cpu")
    assert (ds.micro_batch, ds.grad_accum, ds.precision) == (None, None, None)  # "auto" fixes nothing
    cfg = resolve_auto(ds, batch=2, grad_accum=4, dp=8, stage=3, bf16=True, hidden=4096)
    # transformers/integrations/deepspeed.py trainer_config_process / trainer_config_finalize
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["train_batch_size"] == 2 * 4 * 8
    assert cfg["gradient_clipping"] == 1.0  # TrainingArguments.max_grad_norm's default
    assert cfg["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    zero = cfg["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 10 * 4096
    assert zero["stage3_max_reuse_distance"] == 1e9 and zero["overlap_comm"] is True  # passed through as written
    assert HF_ZERO3["zero_optimization"]["reduce_bucket_size"] == "auto"  # the file's dict is not changed


def test_bucket_sources_name_the_file_hf_auto_and_deepspeeds_defaults(tmp_path):
    config = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": 2e8}}
    ds = read_ds_config(_write(tmp_path, config))
    cfg = resolve_auto(ds, batch=1, grad_accum=1, dp=2, stage=2, bf16=False, hidden=64)
    got = bucket_sources(ds, cfg, 2)
    assert got["reduce_bucket_size"] == {"value": 64 * 64, "source": "HF auto"}
    assert got["allgather_bucket_size"] == {"value": 200_000_000, "source": "file"}
    assert got["sub_group_size"] == {"value": 1_000_000_000, "source": "DeepSpeed default"}
    assert "stage3_prefetch_bucket_size" not in got  # ZeRO-3's only
    # no file: every bucket DeepSpeed's default (deepspeed/runtime/zero/config.py: reduce_bucket_size 5e8)
    defaults = bucket_sources(None, {}, 3)
    assert defaults["reduce_bucket_size"] == {"value": 500_000_000, "source": "DeepSpeed default"}
    assert set(defaults) == set(DEEPSPEED_DEFAULTS)


def test_deepspeed_defaults_are_deepspeeds_own():
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    fields = config.DeepSpeedZeroConfig.model_fields
    by_alias = {(f.alias or name): f.default for name, f in fields.items()}
    for key, value in DEEPSPEED_DEFAULTS.items():
        assert by_alias[key] == value, key


def test_stage3_auto_keys_of_a_lower_stage_are_dropped_and_unfillable_autos_refused(tmp_path):
    ds = read_ds_config(_write(tmp_path, {"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto"}}))
    cfg = resolve_auto(ds, batch=1, grad_accum=1, dp=2, stage=2, bf16=False, hidden=64)
    assert "stage3_prefetch_bucket_size" not in cfg["zero_optimization"]
    ds = read_ds_config(_write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    with pytest.raises(UsageError, match="no hidden_size"):
        resolve_auto(ds, batch=1, grad_accum=1, dp=2, stage=2, bf16=False, hidden=None)
    ds = read_ds_config(_write(tmp_path, {"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}))
    with pytest.raises(UsageError, match="does not fill"):
        resolve_auto(ds, batch=1, grad_accum=1, dp=2, stage=2, bf16=False, hidden=64)


def test_hidden_size_as_transformers_reads_it():
    from types import SimpleNamespace as N

    assert hidden_size(N(hidden_size=64)) == 64
    assert hidden_size(N(hidden_sizes=[32, 96, 64])) == 96
    assert hidden_size(N(text_config=N(hidden_size=48))) == 48
    assert hidden_size(N()) is None


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ("[1, 2]", "a ds_config is a JSON object"),
    ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "device must be none, cpu or nvme"),
    ({"train_micro_batch_size_per_gpu": 0}, "positive integer"),
])
def test_bad_ds_config_is_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "missing.json" if content is None else _write(tmp_path, content)
    with pytest.raises(UsageError) as err:
        read_ds_config(path)
    text = str(err.value)
    assert text.startswith(f"--deepspeed {path}: ") and message in text and "\n" not in text


def test_ds_config_stage_0_is_refused_in_one_line(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 0}})
    with pytest.raises(UsageError, match=r"stage 0 is not ZeRO: drop --deepspeed or set stage 1-3$"):
        read_ds_config(path)


def test_ds_config_fixed_values(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}
    ds = read_ds_config(_write(tmp_path, config))
    assert (ds.stage, ds.micro_batch, ds.grad_accum, ds.precision, ds.offload_optimizer) == (1, 4, 2, "bf16", None)
    ds = read_ds_config(_write(tmp_path, {"fp16": {"enabled": False}}))
    assert ds.precision == "fp32" and ds.stage is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero=2), "zero needs dp N"),
    (dict(dp=2), "apply to zero 1|2|3"),
    (dict(zero=4, dp=2), "zero must be 1, 2 or 3"),
    (dict(zero=2, dp=2, offload_param="cpu"), "it needs zero 3"),
    (dict(zero=3, dp=2, offload_optimizer="nvme"), "NVMe offload is not modelled"),
    (dict(zero=3, dp=2, offload_optimizer="disk"), "unknown offload_optimizer device"),
    (dict(zero=2, dp=2, fsdp=2), "does not combine with fsdp"),
    (dict(zero=3, dp=2, rank=2), "rank must be in 0..1"),
    (dict(zero=2, dp=2, mode="inference"), "runs a training step"),
    (dict(zero=2, dp=2, optimizer_impl="foreach"), "optimizer_impl would not change; drop it"),
    (dict(zero=2, dp=2, zero_grad="zeros", loop="script"), "zero_grad, loop would not change; drop them"),
])
def test_spec_refuses_zero_options_that_do_not_go_together(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RunSpec(LLAMA, batch=2, seq=32, **kwargs)


def test_spec_accepts_zero():
    spec = RunSpec(LLAMA, batch=2, seq=32, zero=3, dp=8, offload_optimizer="cpu", offload_param="CPU", rank=7)
    assert (spec.offload_optimizer, spec.offload_param) == (ZeroOffload.CPU, ZeroOffload.CPU)
    assert spec.world is None  # DeepSpeed's ranks are not torch's sharding world (fsdp × tp)


def _cli(*args: str, env_extra: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + "import sys; from vramtrace.cli import main; sys.argv[0] = 'vramtrace'; sys.exit(main())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300)


# deepspeed hidden, whether installed or not: `import deepspeed` raises ImportError and importlib.util.find_spec
# answers None (as transformers' availability check asks), as without the package
_HIDE_DEEPSPEED = "import sys; sys.modules['deepspeed'] = None\n"


def test_zero_without_deepspeed_is_one_line_exit_1():
    out = _cli(LLAMA, "--seq", "32", "--batch", "2", "--zero", "2", "--dp", "2", "--device", "cpu",
               prelude=_HIDE_DEEPSPEED)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip() == "Error: --zero needs DeepSpeed: pip install 'vramtrace[deepspeed]'"


def test_cli_zero_usage_errors_are_one_line_exit_2(tmp_path):
    out = _cli(LLAMA, "--seq", "32", "--zero", "2")
    assert out.returncode == 2 and out.stderr.strip() == (
        "Error: --zero needs --dp N, the data-parallel ranks (a positive integer), got None")
    bad = _write(tmp_path, "{oops")
    out = _cli(LLAMA, "--seq", "32", "--dp", "2", "--deepspeed", str(bad))
    assert out.returncode == 2 and out.stderr.strip().startswith(f"Error: --deepspeed {bad}: not JSON")


def test_zero_bridges_are_declared_for_deepspeed():
    from vramtrace import bridges

    assert not set(bridges.ZERO_BRIDGES) & set(bridges.BRIDGES)  # not around every step: only a --zero trace's
    for bridge in bridges.ZERO_BRIDGES:
        assert bridge.library == "deepspeed" and bridge.written_for == "deepspeed >=0.19.8,<0.20"
        assert bridge.why and bridge.when_absent
    names = {b.name for b in bridges.ZERO_BRIDGES}
    assert len(names) == len(bridges.ZERO_BRIDGES)


def test_zero_bridges_patch_inside_and_restore_on_exit(monkeypatch):
    pytest.importorskip("deepspeed")
    from vramtrace import bridges, feature_bridges

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    before = {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES}
    real = sys.modules["deepspeed.accelerator.real_accelerator"]
    accelerator_before = real.ds_accelerator
    environ_before = dict(os.environ)
    import logging

    ds_logger = logging.getLogger("DeepSpeed")
    level_before = ds_logger.level
    with feature_bridges.deepspeed_zero(4, 3) as accelerator:
        assert ds_logger.level == logging.ERROR  # its handler writes to stdout, the report's
        assert accelerator.current_device_name() == "meta" and real.ds_accelerator is accelerator
        assert os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "4" and os.environ["LOCAL_RANK"] == "3"
        inside = {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES}
        for name in ("ds_shm_comm", "ds_engine_device", "ds_grad_norm_check", "ds_rank_checks", "ds_offload_norm",
                     "ds_overflow_check", "ds_zero3_linear_autocast"):
            assert inside[name] != before[name], name
    assert {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES} == before
    assert real.ds_accelerator is accelerator_before
    assert dict(os.environ) == environ_before
    assert ds_logger.level == level_before


def test_zero_bridges_restore_when_the_body_raises():
    pytest.importorskip("deepspeed")
    from vramtrace import bridges, feature_bridges

    before = {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES}
    with pytest.raises(RuntimeError, match="boom"), feature_bridges.deepspeed_zero(2, 0):
        raise RuntimeError("boom")
    assert {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES} == before


def test_a_ds_config_given_with_from_is_read_as_deepspeed(tmp_path):
    from vramtrace.sources import read_source
    from vramtrace.sources.base import SourceFormat

    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000000}})
    source = read_source(path)
    assert source.format is SourceFormat.DEEPSPEED  # not a TrainingArguments JSON (gradient_accumulation_steps)
    assert [(e.option, e.value) for e in source.settings] == [("deepspeed_config", str(path.resolve()))]
    # the CLI then reads it as --deepspeed: its stage sets --zero (else --dp alone is refused)
    out = _cli(LLAMA, "--seq", "32", "--dp", "2", "--device", "cpu", "--from", str(path), prelude=_HIDE_DEEPSPEED)
    assert out.returncode == 1 and out.stderr.strip().endswith(
        "Error: --zero needs DeepSpeed: pip install 'vramtrace[deepspeed]'"), out.stderr


def test_training_arguments_deepspeed_key_names_the_ds_config(tmp_path, monkeypatch):
    from vramtrace.sources import read_source

    _write(tmp_path, {"zero_optimization": {"stage": 3}}, "ds_z3.json")
    args = _write(tmp_path, {"per_device_train_batch_size": 2, "output_dir": "out", "deepspeed": "ds_z3.json"},
                  "args.json")
    monkeypatch.chdir(tmp_path)  # the Trainer opens a relative path from the current directory
    got = {e.option: e.value for e in read_source(args).settings}
    assert got["deepspeed_config"] == str(tmp_path / "ds_z3.json")
    monkeypatch.chdir(ROOT)
    source = read_source(args)  # not there from here: one GPU, with the warning
    assert "deepspeed_config" not in {e.option for e in source.settings}
    assert any("pass it as --deepspeed FILE with --dp N" in w for w in source.warnings)


def _real(case: str) -> dict:
    """Rank 0 of a real 2-process DeepSpeed run of the issue-42 research (docs/research/issue-42-zero/real_zero.py:
    tiny-llama-gqa, batch 2 x seq 32, torch_adam AdamW, gloo on the CPU)."""
    path = ROOT / "docs" / "research" / "issue-42-zero" / "results" / "real_llama.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next(r for r in rows if r["case"] == case)["ranks"][0]


def test_zero2_bucket_term_is_the_real_runs(tmp_path):
    """The default reduce_bucket_size (5e8 elements) against 1e6: the predicted peaks differ by what the real runs'
    peaks differ by (the fp32 gradient bucket ZeRO-2 allocates in every backward), to the byte."""
    pytest.importorskip("deepspeed")
    from vramtrace.pipeline import analyze

    small = _write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000000}})
    base = dict(batch=2, seq=32, zero=2, dp=2, device="cpu", precision="fp32", use_cache=False)
    default = analyze(RunSpec(LLAMA, **base), levers=False)
    with_file = analyze(RunSpec(LLAMA, deepspeed_config=str(small), **base), levers=False)
    real = _real("zero2-fp32-default")["peak"] - _real("zero2-fp32-1e6")["peak"]
    assert default.peak_allocated_bytes - with_file.peak_allocated_bytes == real
    buckets = {b.key: (b.value, b.source) for b in with_file.run.zero.buckets}
    assert buckets["reduce_bucket_size"] == (1000000, "file")
    assert {b.key: b.source for b in default.run.zero.buckets}["reduce_bucket_size"] == "DeepSpeed default"


def test_zero_bridge_targets_exist_and_a_missing_one_stops_before_patching(monkeypatch):
    deepspeed = pytest.importorskip("deepspeed")
    from vramtrace import bridges, feature_bridges
    from vramtrace.errors import BridgeError

    for bridge in bridges.ZERO_BRIDGES:
        assert bridges.resolve(bridge) is not None, bridge.name
    before = {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES}
    stage3 = sys.modules["deepspeed.runtime.zero.stage3"]
    monkeypatch.delattr(stage3, "assert_ints_same_as_other_ranks")
    with pytest.raises(BridgeError) as err:
        with feature_bridges.deepspeed_zero(2, 0):
            pytest.fail("deepspeed_zero went on without its target")
    text = str(err.value)
    assert "deepspeed.runtime.zero.stage3.assert_ints_same_as_other_ranks" in text and deepspeed.__version__ in text
    monkeypatch.undo()
    assert {b.name: bridges.resolve(b) for b in bridges.ZERO_BRIDGES} == before


def test_fit_zero_axis_needs_zero_and_dp():
    from vramtrace.fit import fit

    with pytest.raises(UsageError, match="give --zero 1 --dp N"):
        fit(RunSpec(LLAMA, batch=2, seq=32, device="cpu", gpu_memory_bytes=1 << 30), "zero")


def test_a_zero3_trace_leaves_torch_as_it_found_it():
    """ZeRO-3's Init replaces torch.nn.functional.linear "unless manually reset" (partition_parameters.py): after a
    trace, F.linear, DeepSpeed's kept original and every other torch.nn.functional / torch.Tensor name are back."""
    pytest.importorskip("deepspeed")
    import torch
    from vramtrace.pipeline import analyze

    init_class = sys.modules["deepspeed.runtime.zero.partition_parameters"].InsertPostInitMethodToModuleSubClasses
    linear, had_bk = torch.nn.functional.linear, "linear_bk" in vars(init_class)
    functional, tensor = dict(vars(torch.nn.functional)), dict(vars(torch.Tensor))
    analyze(RunSpec(LLAMA, batch=2, seq=32, zero=3, dp=2, device="cpu", precision="fp32", use_cache=False),
            levers=False)
    assert torch.nn.functional.linear is linear
    assert ("linear_bk" in vars(init_class)) == had_bk
    assert {k for k, v in vars(torch.nn.functional).items() if functional.get(k) is not v} == set()
    assert {k for k, v in vars(torch.Tensor).items() if tensor.get(k) is not v} == set()


def test_library_spec_takes_the_files_offloads_and_refuses_a_mismatch(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
                             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "cpu"}}})
    spec = RunSpec(LLAMA, batch=2, seq=32, zero=3, dp=2, grad_accum=4, deepspeed_config=str(path))
    assert (spec.offload_optimizer, spec.offload_param) == (ZeroOffload.CPU, ZeroOffload.CPU)
    for kwargs, message in ((dict(zero=2), "sets zero_optimization.stage 3 but zero is 2"),
                            (dict(batch=4), "sets train_micro_batch_size_per_gpu 2 but batch is 4")):
        with pytest.raises(UsageError, match=message):
            RunSpec(LLAMA, **{**dict(batch=2, seq=32, zero=3, dp=2, deepspeed_config=str(path)), **kwargs})
    fixed = _write(tmp_path, {"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}, "ga.json")
    with pytest.raises(UsageError, match="sets gradient_accumulation_steps 2 but grad_accum is 1"):
        RunSpec(LLAMA, batch=2, seq=32, zero=1, dp=2, deepspeed_config=str(fixed))


def test_clip_grad_norm_sets_deepspeeds_gradient_clipping(tmp_path):
    from vramtrace.tracer.zero import zero_config

    base = dict(batch=2, seq=32, zero=2, dp=2)
    assert zero_config(RunSpec(LLAMA, clip_grad_norm=0.5, **base), False)["gradient_clipping"] == 0.5
    assert "gradient_clipping" not in zero_config(RunSpec(LLAMA, **base), False)  # DeepSpeed's default: none
    path = _write(tmp_path, {"gradient_clipping": 2.0, "zero_optimization": {"stage": 2}})
    assert zero_config(RunSpec(LLAMA, deepspeed_config=str(path), **base), False,
                       read_ds_config(path).config)["gradient_clipping"] == 2.0
    with pytest.raises(UsageError, match="sets gradient_clipping 2.0 but clip_grad_norm is 0.5"):
        RunSpec(LLAMA, deepspeed_config=str(path), clip_grad_norm=0.5, **base)
