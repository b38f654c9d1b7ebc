"""Custom modules (path.py:NAME, package.module:NAME), --input, example_inputs/loss, modules:PATTERN
checkpointing, frozen weights and peft LoRA: predictions against real CPU runs (profiler allocator events)."""

import textwrap
from pathlib import Path

import pytest

from conftest import FIXTURES
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.analysis.categories import Category
from vramtrace.cli import main
from vramtrace.errors import ModelLoadError, UsageError
from vramtrace.custom_inputs import InputSpec, custom_ref

CUSTOM = Path(__file__).resolve().parent.parent / "fixtures" / "custom"
CONVNET = f"{CUSTOM}/convnet.py:ConvNet"
MIXER = f"{CUSTOM}/mixer.py:Mixer"
LLAMA = str(FIXTURES / "tiny-llama-gqa.json")


def _agree(spec: RunSpec) -> tuple[int, int]:
    predicted = analyze(spec).peak_allocated_bytes
    measured = measure_cpu_peak(spec)
    assert_within(predicted, measured, 0.01)
    return predicted, measured


@pytest.mark.parametrize("precision,mode,ckpt", [
    ("fp32", "train", "none"), ("fp32", "train", "modules:blocks.*"), ("bf16-mixed", "train", "none"),
    ("fp32", "inference", "none"), ("bf16-mixed", "inference", "none")])
def test_convnet_matches_real_cpu_step(precision, mode, ckpt):
    # conv + BatchNorm + in-place ReLU + residual; AdamW; loss = output.mean() (no loss() in the file)
    _agree(RunSpec(CONVNET, batch=8, seq=None, inputs=("x=float32[B,3,32,32]",), device="cpu",
                   precision=precision, mode=mode, checkpointing=ckpt))


def test_convnet_pure_bf16_with_bf16_input():
    _agree(RunSpec(CONVNET, batch=4, seq=None, inputs=("x=bfloat16[B,3,16,16]",), device="cpu", precision="bf16"))


@pytest.mark.parametrize("precision,ckpt", [("fp32", "none"), ("bf16-mixed", "none"), ("fp32", "modules:blocks.1")])
def test_mixer_with_example_inputs_and_loss(precision, ckpt):
    # transposes for token mixing; inputs from example_inputs(batch, seq), loss() = cross-entropy on the target
    _agree(RunSpec(MIXER, batch=4, seq=64, device="cpu", precision=precision, checkpointing=ckpt))


def test_checkpointing_modules_saves_memory_and_recomputes():
    base = analyze(RunSpec(MIXER, batch=8, seq=64, device="cpu", precision="fp32"))
    ckpt = analyze(RunSpec(MIXER, batch=8, seq=64, device="cpu", precision="fp32", checkpointing="modules:blocks.*"))
    assert ckpt.activation_bytes < base.activation_bytes
    assert ckpt.recompute_flops > 0 and base.recompute_flops == 0
    assert ckpt.checkpointing.peak_allocated_bytes_without == base.peak_allocated_bytes
    assert "fnmatch" in ckpt.checkpointing.snippet


def test_package_module_reference(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    """))
    monkeypatch.chdir(tmp_path)
    spec = RunSpec("mypkg.nets:build", batch=4, seq=None, inputs=("x=float32[B,8]",), device="cpu", precision="fp32")
    report = analyze(spec)
    assert report.model.params == 8 * 16 + 16 + 16 + 1
    assert report.model.task == "custom"


def test_input_grammar():
    s = InputSpec.parse("ids=int64[B,S]:0..32000")
    assert (s.name, s.dtype, s.dims, s.low, s.high) == ("ids", "int64", ("B", "S"), 0, 32000)
    assert s.shape(4, 128) == (4, 128)
    assert InputSpec.parse("x=float[B,3,224,224]").shape(2, None) == (2, 3, 224, 224)
    assert InputSpec.parse("m=bool[B,S]").value_range == (0, 2)
    for bad in ("x", "x=float32", "x=cuda[B]", "x=float32[B,Q]", "x=float32[B]:0..3", "i=int64[B]:5..5"):
        with pytest.raises(UsageError):
            InputSpec.parse(bad)
    with pytest.raises(UsageError, match="uses S"):
        InputSpec.parse("ids=int64[B,S]").shape(2, None)
    assert custom_ref("a/model.py:Net") == ("a/model.py", "Net")
    assert custom_ref("pkg.mod:make") == ("pkg.mod", "make")
    assert custom_ref("meta-llama/Llama-2-7b") is None


@pytest.mark.parametrize("args,message", [
    ([CONVNET, "--batch", "2"], "needs inputs"),
    ([f"{CUSTOM}/convnet.py:Nope", "--input", "x=float32[B,3,8,8]"], "defines no 'Nope'; its nn.Module classes: Block, ConvNet"),
    ([f"{CUSTOM}/missing.py:Net", "--input", "x=float32[B,3]"], "does not exist"),
    ([CONVNET, "--input", "x=float32[B,3,8,8]", "--checkpointing", "modules:nothing.*"], "matches 'nothing.*'"),
    ([CONVNET, "--input", "x=float32[B,3,8,8]", "--checkpointing", "layers"], "modules:PATTERN"),
    ([LLAMA, "--seq", "8", "--input", "x=float32[B]"], "--input applies to custom modules"),
    ([CONVNET, "--input", "x=float32[B,3,8,8]", "--lora-rank", "4"], "--lora-targets"),
    ([LLAMA, "--seq", "8", "--freeze", "nothing.*"], "matches no parameter"),
    ([LLAMA, "--batch", "2"], "--seq is required"),
])
def test_custom_errors_are_one_line(args, message, capsys):
    code = main(args + ["--device", "cpu"])
    err = capsys.readouterr().err
    assert code in (1, 2) and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("dropout", [None, 0.05])
def test_lora_matches_real_peft_run(dropout):
    """With peft's lora_dropout, each adapter's input goes through a dropout (its mask and output kept for the
    backward)."""
    spec = RunSpec(LLAMA, batch=2, seq=32, device="cpu", precision="bf16-mixed", lora_rank=8,
                   lora_targets=("q_proj", "v_proj", "down_proj"), lora_dropout=dropout)
    report = analyze(spec)
    measured = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, measured, 0.01)
    lora = report.model.trainable_params
    h, inter, kv, layers = 64, 176, 32, 2  # tiny-llama-gqa: hidden 64, intermediate 176, 2 kv heads of 16
    assert lora == layers * 8 * ((h + h) + (h + kv) + (inter + h))  # r * (in + out) per adapted linear
    assert report.run.adapters.startswith("peft LoRA r=8" + (", dropout 0.05" if dropout else " on"))
    grads = [t for t in report.tensors if t.category == Category.GRADIENT]
    assert grads and all("lora_" in t.name for t in grads)  # frozen base weights get no gradient


def test_freeze_drops_gradients_and_optimizer_state():
    full = analyze(RunSpec(LLAMA, batch=2, seq=16, device="cpu", precision="fp32"))
    spec = RunSpec(LLAMA, batch=2, seq=16, device="cpu", precision="fp32", freeze=("model.embed_tokens.*",))
    frozen = analyze(spec)
    emb = 512 * 64 * 4  # vocab 512 x hidden 64, fp32
    assert full.model.trainable_params - frozen.model.trainable_params == 512 * 64
    opt = lambda r: sum(t.bytes for t in r.tensors if t.category == Category.OPTIMIZER_STATE)  # noqa: E731
    assert opt(full) - opt(frozen) == 2 * emb + 4  # AdamW's exp_avg, exp_avg_sq and its 0-dim fp32 step
    _agree(spec)


def test_custom_module_build_failure_is_reported():
    with pytest.raises(ModelLoadError, match="built with no arguments"):
        analyze(RunSpec(f"{CUSTOM}/mixer.py:MixerBlock", batch=2, seq=8, device="cpu"))


def test_op_without_meta_kernel_is_listed_or_refused_under_strict(capsys):
    spec = dict(batch=4, seq=None, inputs=("x=float32[B,8]",), device="cpu", precision="fp32", mode="inference")
    report = analyze(RunSpec(f"{CUSTOM}/nometa.py:Net", **spec))
    assert len(report.unresolved) == 1 and "vt_test.twice.default" in report.unresolved[0]
    assert any(t.op == "vt_test.twice.default" and t.bytes == 4 * 8 * 4 for t in report.tensors)  # sized, not 0
    code = main([f"{CUSTOM}/nometa.py:Net", "--input", "x=float32[B,8]", "--batch", "4", "--device", "cpu",
                 "--mode", "inference", "--strict"])
    err = capsys.readouterr().err
    assert code == 1 and "no meta kernel: vt_test.twice.default in module (root)" in err and "register_fake" in err
