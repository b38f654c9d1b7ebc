"""What a new user meets in the first hour (issue 38): a failed run writes no report file, a composite config's
trace line, errors that name what was passed, and the optimizer names of HF Trainer and bitsandbytes."""

import pytest

from conftest import FIXTURES, run_cli
from oracle import measure_cpu_peak
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.errors import UsageError

TINY = str(FIXTURES / "tiny-llama-gqa.json")
CUSTOM = FIXTURES.parent / "custom"
CONVNET = f"{CUSTOM}/convnet.py:ConvNet"


@pytest.mark.parametrize("option,name", [("--json", "r.json"), ("--html", "r.html"),
                                         ("--snapshot", "r.pickle"), ("--trace-events", "t.json")])
def test_a_failed_run_creates_no_output_file(tmp_path, capsys, option, name):
    """The run fails while tracing (the custom module's forward raises, exit 1): no file is left behind."""
    out = tmp_path / name
    p = run_cli(capsys, f"{CUSTOM}/raises.py:KeyNet", "--input", "x=float32[B,16]", "--batch", "2", "--device",
                "cpu", option, str(out))
    assert p.returncode == 1 and p.stderr.startswith("Error: "), p.stderr
    assert not out.exists()


def test_a_failed_run_leaves_an_existing_output_file_untouched(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text('{"kept": true}')
    p = run_cli(capsys, TINY, "--batch", "2", "--seq", "8", "--device", "cpu", "--freeze", "nothing.*", "--json",
                str(out))
    assert p.returncode != 0 and "matches no parameter" in p.stderr, p.stderr
    assert out.read_text() == '{"kept": true}'


def test_a_successful_run_still_writes(tmp_path, capsys):
    out = tmp_path / "r.json"
    p = run_cli(capsys, TINY, "--batch", "1", "--seq", "8", "--mode", "inference", "--device", "cpu", "--quiet",
                "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_text().startswith("{")


def test_a_composite_config_says_every_layer_traced_without_none(tmp_path):
    """SigLIP's config keeps its layer counts in text_config and vision_config: no top-level num_hidden_layers."""
    from transformers import SiglipConfig

    SiglipConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=100, max_position_embeddings=16),
                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=16, patch_size=8)).save_pretrained(tmp_path)
    report = analyze(RunSpec(str(tmp_path), batch=2, seq=16, device="cpu", mode="inference"))
    assert "None" not in report.run.trace
    assert "every layer traced (the config has no num_hidden_layers)" in report.run.trace


@pytest.mark.parametrize("args,message", [
    (["--fsdp", "2"], "a custom module"),
    (["--use-cache", "false"], "a custom module has no KV-cache option: drop --use-cache"),
])
def test_custom_module_refuses_transformers_options(capsys, args, message):
    p = run_cli(capsys, CONVNET, "--input", "x=float32[B,3,8,8]", "--batch", "2", "--device", "cpu", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "--step" not in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1


def test_fsdp_with_step_names_step(capsys):
    p = run_cli(capsys, TINY, "--batch", "2", "--seq", "8", "--device", "cpu", "--fsdp", "2",
                "--step", f"{FIXTURES.parent}/steps/aux_ema.py:train_step")
    assert p.returncode == 2 and "drop --step or --fsdp" in p.stderr, p.stderr


@pytest.mark.parametrize("name,kind", [
    ("Adam8bit", "adam-8bit"), ("adam8bit", "adam-8bit"), ("adam-8bit", "adam-8bit"), ("adam_8bit", "adam-8bit"),
    ("AdamW8bit", "adamw-8bit"), ("PagedAdamW8bit", "paged-adamw-8bit"), ("adamw_bnb_8bit", "adamw-8bit"),
    ("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"), ("lion_8bit", "lion-8bit"),
    ("adafactor", "adafactor"), ("paged_adamw_8bit", "paged-adamw-8bit"),
])
def test_optimizer_names_accepted(name, kind):
    assert RunSpec(TINY, batch=1, seq=4, optimizer=name).optimizer.value == kind


@pytest.mark.parametrize("name,extra", [
    ("adamw_hf", ""), ("lamb", ""),  # adamw_hf: removed from HF Trainer in transformers 5
    ("galore_adamw_8bit", " (an HF Trainer optim name that vramtrace does not trace yet)"),
    ("adamw_torch_4bit", " (an HF Trainer optim name that vramtrace does not trace yet)"),
])
def test_unsupported_optimizers_get_one_message(name, extra):
    with pytest.raises(UsageError) as e:
        RunSpec(TINY, batch=1, seq=4, optimizer=name)
    assert str(e.value).startswith(f"unsupported optimizer {name!r}{extra}; choose one of: adamw, adam, ")
    assert "adam-8bit" in str(e.value)


def test_adam8bit_matches_bitsandbytes_adam8bit_on_a_real_cpu_run():
    """bitsandbytes' Adam8bit (the oracle builds `bnb.optim.Adam8bit`), traced as `bnb.optim.Adam(optim_bits=8)`.
    Same allowance as the other 8-bit optimizers (test_quantization.py): the host quantile maps' copy on meta."""
    pytest.importorskip("bitsandbytes")
    spec = RunSpec(TINY, batch=2, seq=16, device="cpu", precision="bf16", optimizer="Adam8bit")
    measured = measure_cpu_peak(spec)
    predicted = analyze(spec).peak_allocated_bytes
    assert_within(predicted, measured, 0.005)
