"""The HF Trainer integration (issue 41 item 4): `VramtraceCallback` predicts, at on_train_begin, the step a real
`transformers.Trainer.train()` runs next, and `vramtrace.check(trainer)` does the same without training.

The truth is the same `train()` measured by `MeasureStep`, a TrainerCallback written here from public APIs only
(torch.profiler, tests/oracle.py's measurement): the bytes of the model's parameters and buffers at on_train_begin
plus the running sum of the profiler's `[memory]` events from there (the first step creates the optimizer state),
maximised from on_step_begin to on_step_end of the second optimizer step (the first steady one; with gradient
accumulation, over all its micro-steps)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import oracle
from conftest import FIXTURES
from tolerance import assert_within
import vramtrace
from vramtrace.errors import UsageError, WouldNotFit
from vramtrace.gpus import preset_for_device
from vramtrace.integrations.transformers import VramtraceCallback, checkpointing_of, meta_copy, precision_of
from vramtrace.spec import Precision

ROWS, SEQ, VOCAB = 16, 64, 512
END_MARKER = oracle.MARKER_BYTES + 1


class MeasureStep(TrainerCallback):
    """The peak of the second optimizer step of the train() it is given to (see the module docstring)."""

    def __init__(self):
        self.peak, self.steps_begun, self._prof = None, 0, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        alive = [*model.parameters(), *model.buffers()]
        for p in model.parameters():  # bitsandbytes' QuantState: absmax, code, offset, and its nested state
            state = getattr(p, "quant_state", None)
            while state is not None:
                alive += [t for t in (getattr(state, k, None) for k in ("absmax", "code", "offset"))
                          if isinstance(t, torch.Tensor)]
                state = getattr(state, "state2", None)
        self.start = oracle.storage_bytes(alive)
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps_begun += 1
        if state.global_step == 1:
            marker = torch.empty(oracle.MARKER_BYTES, dtype=torch.uint8)
            del marker

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        marker = torch.empty(END_MARKER, dtype=torch.uint8)
        del marker
        self._prof.__exit__(None, None, None)
        warm, measured, part = [], [], 0
        for e in sorted((e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
            n = e.nbytes()
            if abs(n) in (oracle.MARKER_BYTES, END_MARKER):
                part += n > 0
                continue
            if part < 2:
                (measured if part else warm).append(n)
        self.peak = oracle._peak((self.start, warm, measured))

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None and self.peak is None:
            self._prof.__exit__(None, None, None)


class Rows(torch.utils.data.Dataset):
    """Fixed-length causal-LM rows (input_ids, labels), drawn once."""

    def __init__(self, seq: int = SEQ):
        g = torch.Generator().manual_seed(0)
        self.rows = [{"input_ids": torch.randint(0, VOCAB, (seq,), generator=g),
                      "labels": torch.randint(0, VOCAB, (seq,), generator=g)} for _ in range(ROWS)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def tiny_llama(lora: bool = False, qlora_dir=None):
    """The tiny Llama (seed 0); with `lora` a peft LoRA r=8 on it; with `qlora_dir` saved there and loaded back in
    4-bit NF4 (bitsandbytes), `prepare_model_for_kbit_training` (its default: reentrant checkpointing), LoRA r=8."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(FIXTURES / "tiny-llama-gqa.json"))
    if qlora_dir is not None:
        import peft
        from transformers import BitsAndBytesConfig

        model.save_pretrained(qlora_dir)
        nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        model = AutoModelForCausalLM.from_pretrained(qlora_dir, device_map="cpu", quantization_config=nf4)
        return peft.get_peft_model(peft.prepare_model_for_kbit_training(model), peft.LoraConfig(r=8))
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8))
    return model


def trainer(tmp_path, model, callbacks=(), seq: int = SEQ, **args) -> Trainer:
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, report_to="none",
                    use_cpu=True, save_strategy="no", logging_strategy="no", optim="adamw_torch",
                    disable_tqdm=True)
    return Trainer(model=model, args=TrainingArguments(**{**defaults, **args}), train_dataset=Rows(seq),
                   callbacks=list(callbacks))


CASES = {
    "fp32-adamw": {},
    "bf16-mixed": {"bf16": True},
    "checkpointing": {"activation_checkpointing": True},  # 5.24's name of gradient_checkpointing
    "grad-accum-2": {"gradient_accumulation_steps": 2},
    "fused-adamw": {"optim": "adamw_torch_fused"},  # TrainingArguments' default optim
    "lora": {"lora": True},
    "qlora": {"qlora": True},
}


@pytest.mark.parametrize("case", CASES)
def test_callback_predicts_the_real_steady_step(tmp_path, case):
    args = dict(CASES[case])
    lora, qlora = args.pop("lora", False), args.pop("qlora", False)
    if lora or qlora:
        pytest.importorskip("peft", reason="LoRA needs the [lora] extra (peft)")
    if qlora:
        pytest.importorskip("bitsandbytes", reason="QLoRA needs the [quant] extra (bitsandbytes)")
    predict, measure = VramtraceCallback(), MeasureStep()
    model = tiny_llama(lora, qlora_dir=tmp_path / "saved" if qlora else None)
    trainer(tmp_path, model, [predict, measure], **args).train()
    assert predict.report is not None and measure.peak is not None
    assert_within(predict.report.peak_allocated_bytes, measure.peak, 0.001, case)
    print(f"\n{case}: predicted {predict.report.peak_allocated_bytes:,} B, measured {measure.peak:,} B "
          f"({predict.report.peak_allocated_bytes - measure.peak:+,} B)")  # pytest -s: docs/integrations.md's table


def test_check_without_a_callback_gives_the_callbacks_figure_and_leaves_the_model_alone(tmp_path):
    model = tiny_llama()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    t = trainer(tmp_path, model)
    report = vramtrace.check(t, on_oom_risk="ignore")
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and p.grad is None
        assert p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1])
    predict = VramtraceCallback(on_oom_risk="ignore")
    t.add_callback(predict)
    t.train()
    assert report.peak_allocated_bytes == predict.report.peak_allocated_bytes
    assert report.run.batch == 2 and report.run.seq == SEQ


def test_seq_replaces_the_collated_length(tmp_path):
    """check(trainer of 64-token rows, seq=32) predicts the real step of a trainer of 32-token rows."""
    predicted = vramtrace.check(trainer(tmp_path, tiny_llama()), seq=32, on_oom_risk="ignore")
    measure = MeasureStep()
    trainer(tmp_path, tiny_llama(), [measure], seq=32).train()
    assert predicted.run.seq == 32
    assert_within(predicted.peak_allocated_bytes, measure.peak, 0.001, "seq=32")
    print(f"\nseq=32: predicted {predicted.peak_allocated_bytes:,} B, measured {measure.peak:,} B")


def test_a_cpu_trainer_checked_for_a_gpu(tmp_path):
    report = vramtrace.check(trainer(tmp_path, tiny_llama()), device="cuda", gpu="A100-40GB", on_oom_risk="ignore")
    assert report.run.device == "cuda" and report.fit.gpu == "A100-40GB" and report.fit.fits
    assert report.peak_reserved_bytes >= report.peak_allocated_bytes


def allocated_bytes(prof) -> int:
    """The bytes the profiled code allocated (its `[memory]` events' allocations, frees not subtracted)."""
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0)


def test_meta_copy_of_a_qlora_model_keeps_params4bit_and_allocates_nothing(tmp_path):
    pytest.importorskip("peft", reason="LoRA needs the [lora] extra (peft)")
    bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs the [quant] extra (bitsandbytes)")
    model = tiny_llama(qlora_dir=tmp_path)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        copied = meta_copy(model)
    assert allocated_bytes(prof) == 0
    real = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    twin = copied.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert type(twin) is bnb.nn.Params4bit and twin.device.type == "meta" and twin.shape == real.shape
    assert twin.quant_state.absmax.device.type == "meta" and twin.quant_type == real.quant_type == "nf4"
    assert real.device.type == "cpu" and real.quant_state.absmax.device.type == "cpu"


def test_a_cuda_model_is_checked_on_its_gpu_with_what_the_process_may_use(monkeypatch):
    """The device name picks the preset; the capacity is mem_get_info's free bytes plus what this process has
    reserved plus the CUDA context the verdict counts (the context is in the predicted figure)."""
    from vramtrace import RunSpec
    from vramtrace.integrations.transformers import target_of

    gib = 1 << 30
    cuda0 = torch.device("cuda", 0)
    model = type("OnCuda", (), {"parameters": lambda self: iter([type("P", (), {"device": cuda0})()])})()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 40 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    target = target_of(model, None, None, None, 0.0)
    context = RunSpec("m", 1, None, gpu="A100-40GB", cuda_version=target.get("cuda_version")).cuda_context
    assert target["gpu"] == "A100-40GB" and target["gpu_memory_bytes"] == 12 * gib + context > 12 * gib
    assert target_of(model, None, None, None, 0.5)["gpu_memory_bytes"] == (12 * gib + context) // 2
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    with pytest.raises(UsageError, match="pass gpu="):
        target_of(model, None, None, None, 0.0)


def test_meta_copy_allocates_nothing_and_keeps_types_and_requires_grad():
    pytest.importorskip("peft", reason="LoRA needs the [lora] extra (peft)")
    model = tiny_llama(lora=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        copied = meta_copy(model)
    assert allocated_bytes(prof) == 0
    real, meta = dict(model.named_parameters()), dict(copied.named_parameters())
    assert real.keys() == meta.keys()
    for n, p in meta.items():
        assert p.device.type == "meta" and type(p) is type(real[n])
        assert (p.shape, p.dtype, p.requires_grad) == (real[n].shape, real[n].dtype, real[n].requires_grad)
    assert type(copied) is type(model) and all(t.device.type == "cpu" for t in model.parameters())
    base = copied.get_base_model()
    assert base.lm_head.weight is not base.model.embed_tokens.weight  # untied in the config, untied in the copy


def test_raise_stops_before_the_first_step_naming_a_lever(tmp_path):
    peak = vramtrace.check(trainer(tmp_path, tiny_llama()), on_oom_risk="ignore").peak_allocated_bytes
    seen = MeasureStep()
    t = trainer(tmp_path, tiny_llama(), [VramtraceCallback(on_oom_risk="raise", gpu_memory=peak - 1), seen])
    with pytest.raises(WouldNotFit, match=r"does not fit .*levers that fit: .*--"):
        t.train()
    assert seen.steps_begun == 0


def test_warn_logs_the_peak_and_a_warning(tmp_path, caplog):
    t = trainer(tmp_path, tiny_llama())
    with caplog.at_level("INFO", logger="vramtrace"):
        report = vramtrace.check(t, gpu_memory=1 << 20, json_path=str(tmp_path / "report.json"))
    assert not report.fit.fits
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["peak_allocated_bytes"] == report.peak_allocated_bytes and saved["fit"]["fits"] is False
    assert any("predicted peak" in r.message and r.levelname == "INFO" for r in caplog.records)
    assert any("does not fit" in r.message and r.levelname == "WARNING" for r in caplog.records)


def test_an_unknown_on_oom_risk_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown on_oom_risk 'explode'; choose one of: warn, raise, ignore"):
        VramtraceCallback(on_oom_risk="explode")


def _args(**kw):
    base = dict(bf16=False, fp16=False, activation_checkpointing=False, activation_checkpointing_kwargs=None,
                gradient_checkpointing=False, gradient_checkpointing_kwargs=None)
    return type("Args", (), {**base, **kw})()


def test_precision_from_the_flags_and_the_weights_dtype():
    fp32 = torch.nn.Linear(2, 2)
    bf16 = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert precision_of(fp32, _args()) is Precision.FP32
    assert precision_of(fp32, _args(bf16=True)) is Precision.BF16_MIXED
    assert precision_of(fp32, _args(fp16=True)) is Precision.FP16_MIXED
    assert precision_of(bf16, _args()) is Precision.BF16
    assert precision_of(bf16, _args(bf16=True)) is Precision.BF16_AUTOCAST


def test_checkpointing_from_the_arguments():
    model = torch.nn.Linear(2, 2)
    assert checkpointing_of(model, _args()) == "none"
    assert checkpointing_of(model, _args(gradient_checkpointing=True)) == "layers"
    assert checkpointing_of(model, _args(activation_checkpointing=True,
                                         activation_checkpointing_kwargs={"use_reentrant": True})) == "layers:reentrant"
    assert checkpointing_of(model, _args(activation_checkpointing=True,
                                         activation_checkpointing_kwargs={"every_n_layers": 2})) == "nth:2"
    with pytest.raises(UsageError, match="offload"):
        checkpointing_of(model, _args(activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True}))


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA H100 NVL", "H100-NVL"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA GeForce RTX 4090", "RTX4090"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"), ("Tesla T4", "T4"), ("NVIDIA H200", "H200")])
def test_device_names_map_to_presets(name, preset):
    assert preset_for_device(name).name == preset


def test_an_unknown_device_name_maps_to_no_preset():
    assert preset_for_device("NVIDIA GeForce GTX 1080") is None
