"""Architectures users have today beyond text LMs (issue 38, section 4): Mamba2 (an SSM whose config holds
Infinity), Whisper (speech seq2seq, input_features), wav2vec2 (input_values) and DINOv2 as the Hub ships it (a
base model, no head). Each tiny config is written by transformers' own `XConfig(...).save_pretrained(dir)`, and
each trace is checked against the same step run for real on the CPU (tests/oracle.py: public APIs only), Whisper's
generate() included."""

from __future__ import annotations

import json

import pytest

from oracle import measure_cpu_peak
from seam import loaded_model
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import UsageError
from vramtrace.tracer.loading import resolve_config

TINY = dict(num_hidden_layers=2)


def _save(tmp_path, name: str, config) -> str:
    directory = tmp_path / name
    config.save_pretrained(directory)
    return str(directory)


def _mamba2(tmp_path) -> str:
    from transformers import Mamba2Config

    return _save(tmp_path, "mamba2", Mamba2Config(
        hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2, chunk_size=16, vocab_size=256,
        architectures=["Mamba2ForCausalLM"], **TINY))


def _whisper(tmp_path, **overrides) -> str:
    from transformers import WhisperConfig

    fields = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256, num_mel_bins=80, max_source_positions=1500,
                  max_target_positions=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                  architectures=["WhisperForConditionalGeneration"])
    return _save(tmp_path, "whisper", WhisperConfig(**{**fields, **overrides}))


def _wav2vec2(tmp_path, arch: str, **extra) -> str:
    from transformers import Wav2Vec2Config

    return _save(tmp_path, arch, Wav2Vec2Config(
        hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=32, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        classifier_proj_size=32, architectures=[arch], **TINY, **extra))


def _dinov2(tmp_path) -> str:
    from transformers import Dinov2Config

    return _save(tmp_path, "dinov2", Dinov2Config(
        hidden_size=64, num_attention_heads=4, intermediate_size=128, image_size=56, patch_size=14,
        architectures=["Dinov2Model"], **TINY))


def _matches_real(spec: RunSpec):
    report = analyze(spec)
    real = measure_cpu_peak(spec)
    assert_within(report.peak_allocated_bytes, real, 0.001)
    return report


# -- Mamba2: a config with Infinity; CPU autocast inside einsum -----------------------------------------------------
def test_a_config_transformers_saved_with_infinity_is_read(tmp_path):
    """save_pretrained writes Mamba2's time_step_limit (0.0, inf) as {"__float__": "Infinity"}: it is read back as
    transformers reads it."""
    path = _mamba2(tmp_path)
    assert {"__float__": "Infinity"} in json.loads((tmp_path / "mamba2" / "config.json").read_text())["time_step_limit"]
    assert resolve_config(path).config["time_step_limit"] == [0.0, float("inf")]


@pytest.mark.parametrize("mode,precision", [("train", "fp32"), ("train", "bf16-mixed"), ("inference", "fp32"),
                                            ("inference", "bf16-mixed")])
def test_mamba2_matches_a_real_cpu_step(tmp_path, mode, precision):
    _matches_real(RunSpec(_mamba2(tmp_path), batch=2, seq=64, mode=mode, device="cpu", precision=precision))


def test_mamba2_generate_matches_a_real_cpu_generate(tmp_path):
    _matches_real(RunSpec(_mamba2(tmp_path), batch=2, seq=8, mode="generate", new_tokens=6, device="cpu",
                          precision="fp32"))


def test_cpu_autocast_casts_inside_einsum_as_torch_does():
    """Real CPU autocast computes einsum's inner bmm in bf16 though einsum is not on its CPU list; the emulation
    gives the same dtypes on meta (an fp32 and a bf16 operand: Mamba2's `new_states` einsum)."""
    import torch

    from vramtrace.spec import Device
    from vramtrace.tracer.kernels import KernelPolicyMode

    def run(device, autocast):
        a = torch.randn(2, 3, 4, device=device)
        b = torch.randn(2, 3, 5, device=device, dtype=torch.bfloat16)
        with autocast:
            return [torch.einsum("bzc,bzp->bcp", a, b).dtype, torch.tensordot(a, a, dims=([2], [2])).dtype,
                    torch.inner(a, a).dtype]

    real = run("cpu", torch.autocast("cpu", dtype=torch.bfloat16))
    mode = KernelPolicyMode(Device.CPU, 0, torch.bfloat16)
    with mode:
        with mode.autocast_region():
            traced = run("meta", __import__("contextlib").nullcontext())
    assert traced == real == [torch.bfloat16] * 3


# -- Whisper ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,precision", [("train", "fp32"), ("train", "bf16-mixed"), ("inference", "fp32")])
def test_whisper_matches_a_real_cpu_step(tmp_path, mode, precision):
    _matches_real(RunSpec(_whisper(tmp_path), batch=2, seq=64, mode=mode, device="cpu", precision=precision))


def test_whisper_input_features_have_the_feature_extractors_shape(tmp_path):
    """(B, num_mel_bins, 3000): WhisperFeatureExtractor pads a clip to 30 s, 3,000 frames."""
    import numpy as np
    from transformers import WhisperFeatureExtractor

    path = _whisper(tmp_path)
    loaded = loaded_model(RunSpec(path, batch=2, seq=16, mode="inference", device="cpu"))
    shapes = {name: shape for name, _, shape in loaded.input_summary()}
    real = WhisperFeatureExtractor(feature_size=80)([np.zeros(16000, np.float32)] * 2, sampling_rate=16000,
                                                    return_tensors="pt").input_features
    assert tuple(shapes["input_features"]) == tuple(real.shape) == (2, 80, 3000)
    assert tuple(shapes["decoder_input_ids"]) == (2, 16)


# Whisper's generate(input_features, max_new_tokens=N, min_new_tokens=N, do_sample=False): short-form, one window.
# A 1 s window (50 source positions) keeps the encoder small, so that the decode steps' growing cache makes the
# peak; pad = EOS as in Whisper's checkpoints (min_new_tokens masks both).
SHORT_WINDOW = dict(max_source_positions=50, pad_token_id=2)


@pytest.mark.parametrize("overrides,seq,new_tokens,extra", [
    (SHORT_WINDOW, 1, 40, {}),  # the prompt is decoder_start_token_id; the peak in the last decode steps
    ({}, 1, 4, {}),  # the 30 s window (3,000 frames); pad (0) is not EOS (2)
    ({**SHORT_WINDOW, "forced_decoder_ids": [[1, 5], [2, 6], [3, None]], "suppress_tokens": [3, 4]}, 3, 8,
     {"cache": "static", "precision": "bf16-mixed"}),  # a forced prompt, a suppress-tokens processor, StaticCache
], ids=["decode-peak", "30s-window", "forced-prompt-static-bf16"])
def test_whisper_generate_matches_a_real_cpu_generate(tmp_path, overrides, seq, new_tokens, extra):
    spec = RunSpec(_whisper(tmp_path, **overrides), batch=2, seq=seq, mode="generate", new_tokens=new_tokens,
                   device="cpu", **{"precision": "fp32", **extra})
    report = _matches_real(spec)
    if new_tokens == 40:  # the case checks the decode steps, not only the encoder
        assert report.run.peak_in.startswith("decode step")


@pytest.mark.parametrize("seq,new_tokens,needle", [("4", "8", "pass --seq 1"),
                                                   ("1", "128", "use --new-tokens 127 or fewer")])
def test_whisper_generate_seq_is_its_decoder_prompt(tmp_path, capsys, seq, new_tokens, needle):
    """Whisper's generate() builds its decoder prompt itself (decoder_start_token_id, forced_decoder_ids): --seq
    must say that length, and the prompt plus the new tokens fit max_target_positions (128), else one line."""
    assert main([_whisper(tmp_path), "--batch", "2", "--seq", seq, "--mode", "generate", "--new-tokens", new_tokens,
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("forced", [None, [[1, 5], [2, 6], [3, None]], [[1, 5], [2, 6], [3, 7]], [[2, 5]]])
def test_whisper_prompt_is_the_one_a_real_generate_feeds_the_decoder(tmp_path, forced):
    """`whisper_prompt_tokens` against the decoder_input_ids a real generate() gives the first forward."""
    import torch
    from transformers import AutoConfig, WhisperForConditionalGeneration

    from vramtrace.tracer.building import whisper_prompt_tokens

    config = AutoConfig.from_pretrained(_whisper(tmp_path, **SHORT_WINDOW, forced_decoder_ids=forced))
    model = WhisperForConditionalGeneration(config).eval()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["decoder_input_ids"].shape[-1]), with_kwargs=True)
    model.generate(input_features=torch.randn(2, 80, 100), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert whisper_prompt_tokens(config) == seen[0]


# -- wav2vec2-style input_values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,mode,precision", [
    ("Wav2Vec2ForCTC", "inference", "fp32"), ("Wav2Vec2Model", "train", "fp32"),
    ("Wav2Vec2Model", "train", "bf16-mixed"),
    ("Wav2Vec2ForSequenceClassification", "train", "fp32")])
def test_wav2vec2_matches_a_real_cpu_step(tmp_path, arch, mode, precision):
    """--seq is the audio samples (4,000: a quarter second at 16 kHz). Training without SpecAugment and LayerDrop:
    both draw at random (the trace refuses the first, traces the second with every layer running)."""
    path = _wav2vec2(tmp_path, arch, apply_spec_augment=False, layerdrop=0.0)
    _matches_real(RunSpec(path, batch=2, seq=4000, mode=mode, device="cpu", precision=precision))


def test_layerdrop_is_traced_as_every_layer_running(tmp_path):
    """The worst case of LayerDrop's draws, the same every run: the peak of the config without LayerDrop."""
    drop = _wav2vec2(tmp_path / "drop", "Wav2Vec2Model", apply_spec_augment=False, layerdrop=0.5)
    none = _wav2vec2(tmp_path / "none", "Wav2Vec2Model", apply_spec_augment=False, layerdrop=0.0)
    peaks = [analyze(RunSpec(p, batch=2, seq=4000, device="cpu", precision="fp32")).peak_allocated_bytes
             for p in (drop, drop, none)]
    assert peaks[0] == peaks[1] == peaks[2]


@pytest.mark.parametrize("arch,needle", [("Wav2Vec2Model", "SpecAugment"), ("Wav2Vec2ForCTC", "CTC training")])
def test_wav2vec2_training_it_cannot_trace_is_refused_in_one_line(tmp_path, capsys, arch, needle):
    path = _wav2vec2(tmp_path, arch, apply_spec_augment=True, mask_time_prob=0.05)
    assert main([path, "--batch", "2", "--seq", "4000", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and needle in err and len(err.splitlines()) == 1


def test_audio_shorter_than_the_receptive_field_is_refused(tmp_path):
    with pytest.raises(UsageError, match="receptive field"):
        analyze(RunSpec(_wav2vec2(tmp_path, "Wav2Vec2Model"), batch=2, seq=12, mode="inference", device="cpu"))


# -- DINOv2 as on the Hub: a base model, --task feature-extraction ---------------------------------------------------
@pytest.mark.parametrize("mode,precision", [("train", "fp32"), ("train", "bf16-mixed"), ("inference", "fp32")])
def test_dinov2_base_model_matches_a_real_cpu_step(tmp_path, mode, precision):
    """Dinov2Model has no head: trained on the mean of its last hidden state (as the oracle's user does)."""
    report = _matches_real(RunSpec(_dinov2(tmp_path), batch=2, seq=None, mode=mode, device="cpu", precision=precision))
    assert report.model.task == "feature-extraction"


def test_task_feature_extraction_builds_the_base_model(tmp_path):
    """--task feature-extraction on a config whose architectures name a head: AutoModel's class, no labels."""
    from transformers import Dinov2Config

    path = _save(tmp_path, "dinov2-cls", Dinov2Config(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                                      image_size=56, patch_size=14, num_hidden_layers=2,
                                                      architectures=["Dinov2ForImageClassification"]))
    report = analyze(RunSpec(path, batch=2, seq=None, device="cpu", precision="fp32", task="feature-extraction"))
    assert report.model.architecture == "Dinov2Model" and report.model.task == "feature-extraction"
