"""Task heads (sequence and token classification, question answering, multiple choice) and --attn-implementation:
inputs and labels follow the head transformers builds, and predictions match real CPU runs (tests/oracle.py)
within 0.1%."""

import json

import pytest
import torch

import oracle
from conftest import FIXTURES
from oracle import measure_cpu_peak
from seam import loaded_model
from tolerance import assert_within
from vramtrace import RunSpec, analyze
from vramtrace.cli import main
from vramtrace.errors import ModelLoadError, UsageError

MODELS = {"tiny-bert": "Bert", "tiny-roberta": "Roberta", "tiny-llama-gqa": "Llama"}
HEADS = {"sequence-classification": "ForSequenceClassification", "token-classification": "ForTokenClassification",
         "question-answering": "ForQuestionAnswering"}
TOLERANCE = 0.001  # 0.1% of the measured peak


def head_config(tmp_path, config: str, arch: str | None, **extra) -> str:
    """A copy of fixture `config` with `architectures` = [arch] (None: no architectures), 3 labels (QA: 2) and a pad
    token (Llama's sequence classifier needs one for B > 1), plus `extra`; returns its path."""
    cfg = json.loads((FIXTURES / f"{config}.json").read_text())
    cfg.pop("architectures", None)
    if arch is not None:
        cfg["architectures"] = [arch]
    cfg["num_labels"] = 2 if arch and arch.endswith("ForQuestionAnswering") else 3  # QA: start and end logits
    cfg.setdefault("pad_token_id", 0)
    cfg.update(extra)
    path = tmp_path / f"{config}-{arch or 'noarch'}-{abs(hash(json.dumps(extra, sort_keys=True)))}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def assert_close(predicted: int, measured: int) -> None:
    assert_within(predicted, measured, TOLERANCE)


@pytest.mark.parametrize("precision,mode", [("fp32", "train"), ("bf16-mixed", "train"), ("bf16", "inference")])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("config", list(MODELS))
def test_head_matches_real_cpu_run(tmp_path, config, head, precision, mode):
    arch = MODELS[config] + HEADS[head]
    spec = RunSpec(head_config(tmp_path, config, arch), batch=2, seq=32, device="cpu", precision=precision,
                   mode=mode)
    report = analyze(spec)
    assert report.model.task == head and report.model.architecture == arch
    assert_close(report.peak_allocated_bytes, measure_cpu_peak(spec))


@pytest.mark.parametrize("config,choices", [("tiny-bert", None), ("tiny-roberta", 3)])
def test_multiple_choice_matches_real_cpu_run(tmp_path, config, choices):
    arch = MODELS[config] + "ForMultipleChoice"
    spec = RunSpec(head_config(tmp_path, config, arch), batch=2, seq=32, device="cpu", precision="fp32",
                   choices=choices)
    report = analyze(spec)
    assert report.model.task == "multiple-choice"
    assert_close(report.peak_allocated_bytes, measure_cpu_peak(spec))


def _meta_inputs(spec: RunSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    loaded = loaded_model(spec)
    return {k: (tuple(v.shape), v.dtype) for k, v in loaded.inputs.items() if isinstance(v, torch.Tensor)}


def test_inputs_follow_the_head(tmp_path):
    B, S, i64 = 4, 16, torch.int64

    def inputs(arch, **kw):
        return _meta_inputs(RunSpec(head_config(tmp_path, "tiny-bert", arch, **kw.pop("cfg", {})), batch=B, seq=S,
                                    device="cpu", precision="fp32", **kw))

    assert inputs("BertForSequenceClassification") == {"input_ids": ((B, S), i64), "labels": ((B,), i64)}
    assert inputs("BertForTokenClassification") == {"input_ids": ((B, S), i64), "labels": ((B, S), i64)}
    assert inputs("BertForQuestionAnswering") == {"input_ids": ((B, S), i64), "start_positions": ((B,), i64),
                                                  "end_positions": ((B,), i64)}
    assert inputs("BertForMultipleChoice") == {"input_ids": ((B, 2, S), i64), "labels": ((B,), i64)}
    assert inputs("BertForMultipleChoice", choices=5) == {"input_ids": ((B, 5, S), i64), "labels": ((B,), i64)}
    assert inputs("BertForMaskedLM") == {"input_ids": ((B, S), i64), "labels": ((B, S), i64)}
    assert inputs("BertForSequenceClassification", mode="inference") == {"input_ids": ((B, S), i64)}
    # labels as transformers' ForSequenceClassificationLoss reads them: regression and multi-label are floats
    assert inputs("BertForSequenceClassification", cfg={"num_labels": 1})["labels"] == ((B,), torch.float32)
    assert inputs("BertForSequenceClassification", cfg={"problem_type": "multi_label_classification"})["labels"] \
        == ((B, 3), torch.float32)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
@pytest.mark.parametrize("cfg", [{"num_labels": 1}, {"problem_type": "regression"},
                                 {"problem_type": "multi_label_classification"}])
def test_float_label_heads_match_real_cpu_run(tmp_path, cfg, precision):
    """Regression and multi-label sequence classification: float labels in the weight dtype."""
    spec = RunSpec(head_config(tmp_path, "tiny-bert", "BertForSequenceClassification", **cfg), batch=2, seq=16,
                   device="cpu", precision=precision)
    assert_close(analyze(spec).peak_allocated_bytes, measure_cpu_peak(spec))


@pytest.mark.parametrize("task", ["sequence-classification", "text-classification", "token-classification",
                                  "question-answering"])
def test_task_overrides_architectures(tmp_path, task):
    """--task builds the head over the config's BertForMaskedLM, and picks it when architectures is absent; both
    equal a real run of the config naming that head."""
    canonical = {"text-classification": "sequence-classification"}.get(task, task)
    arch = "Bert" + HEADS[canonical]
    truth = measure_cpu_peak(RunSpec(head_config(tmp_path, "tiny-bert", arch), batch=2, seq=32, device="cpu",
                                     precision="bf16-mixed"))
    labels = {"num_labels": 2} if canonical == "question-answering" else {}
    for base in ("BertForMaskedLM", None):
        spec = RunSpec(head_config(tmp_path, "tiny-bert", base, **labels), batch=2, seq=32, device="cpu",
                       precision="bf16-mixed", task=task)
        report = analyze(spec)
        assert (report.model.task, report.model.architecture) == (canonical, arch)
        assert_close(report.peak_allocated_bytes, truth)


def test_task_errors(tmp_path, capsys):
    bert = head_config(tmp_path, "tiny-bert", "BertForMaskedLM")
    assert main([bert, "--seq", "8", "--task", "summarise-this"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: unknown task 'summarise-this'; choose one of: ") and len(err.strip().splitlines()) == 1
    for name in ("sequence-classification", "text-classification", "question-answering", "multiple-choice",
                 "causal-lm", "text-generation", "fill-mask", "text2text-generation", "image-classification"):
        assert name in err
    with pytest.raises(ModelLoadError, match=r"model_type 'llama' has no multiple-choice head"):
        loaded_model(RunSpec(FIXTURES.joinpath("tiny-llama-gqa.json").as_posix(), batch=1, seq=8, task="multiple-choice"))
    assert main([bert, "--seq", "8", "--task", "seq2seq-lm"]) == 1
    err = capsys.readouterr().err
    assert "model_type 'bert' has no seq2seq-lm head" in err and len(err.strip().splitlines()) == 1
    assert main([bert, "--seq", "8", "--task", "question-answering"]) == 1  # 3 labels: no start and end logits
    assert "BertForQuestionAnswering splits its logits into start and end" in capsys.readouterr().err
    assert main([bert, "--seq", "8", "--choices", "3"]) == 2  # --choices without a multiple-choice head
    assert "--choices applies to multiple-choice heads" in capsys.readouterr().err
    with pytest.raises(UsageError, match="choices applies"):
        RunSpec(bert, batch=1, seq=8, task="ner", choices=3)


def test_attn_implementation_eager_vs_sdpa(tmp_path):
    """--attn-implementation selects what `from_config(attn_implementation=...)` selects; the oracle reads the
    config key `attn_implementation`, which transformers' config honours. On this CPU, SDPA runs its flash
    kernel without attention dropout (inference, or dropout 0) and eager's (B, H, S, S) scores and probabilities
    make its peak larger; with dropout SDPA falls back to the math kernel."""
    base = head_config(tmp_path, "tiny-bert", "BertForSequenceClassification")
    peaks = {}
    for mode, extra in (("inference", {}), ("train", {"attention_probs_dropout_prob": 0.0})):
        for attn in ("eager", "sdpa"):
            truth_config = head_config(tmp_path, "tiny-bert", "BertForSequenceClassification",
                                       attn_implementation=attn, **extra)
            built = oracle.hf_model(oracle.hf_config(truth_config), torch.float32)
            assert built.config._attn_implementation == attn  # transformers honours the key
            measured = measure_cpu_peak(RunSpec(truth_config, batch=4, seq=64, device="cpu", precision="fp32",
                                                mode=mode))
            spec = RunSpec(head_config(tmp_path, "tiny-bert", "BertForSequenceClassification", **extra), batch=4,
                           seq=64, device="cpu", precision="fp32", mode=mode, attn_implementation=attn)
            report = analyze(spec)
            assert report.model.attn_implementation == attn
            assert_close(report.peak_allocated_bytes, measured)
            peaks[mode, attn] = measured
        assert peaks[mode, "eager"] > 1.1 * peaks[mode, "sdpa"], peaks
    # without the flag, transformers' default for BERT is sdpa
    assert analyze(RunSpec(base, batch=1, seq=8, device="cpu")).model.attn_implementation == "sdpa"


@pytest.mark.parametrize("args,needle", [
    (["--attn-implementation", "flash_attention_2", "--device", "cpu"], "runs only on CUDA GPUs"),
    (["--attn-implementation", "flash_attention_2", "--mode", "generate", "--new-tokens", "2", "--cache", "static"],
     "flash_attention_2 with --cache static is not traced"),
    (["--attn-implementation", "flash_attention_2", "--precision", "fp32"], "flash_attention_2 runs fp16 and bf16"),
    (["--attn-implementation", "flex_attention"], "flex_attention cannot be traced"),
])
def test_untraceable_attention_is_an_error(capsys, args, needle):
    assert main([str(FIXTURES / "tiny-bert.json"), "--seq", "8", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: attention ") and needle in err and len(err.strip().splitlines()) == 1


def test_config_key_flex_attention_is_refused(tmp_path):
    """The config's own attn_implementation is checked too: no trace failure deep in torch."""
    path = head_config(tmp_path, "tiny-llama-gqa", "LlamaForCausalLM", attn_implementation="flex_attention")
    with pytest.raises(ModelLoadError, match="flex_attention cannot be traced"):
        loaded_model(RunSpec(path, batch=1, seq=8))


def test_unknown_attn_implementation_is_a_usage_error(capsys):
    assert main([str(FIXTURES / "tiny-bert.json"), "--seq", "8", "--attn-implementation", "fast"]) == 2
    assert "unknown attention implementation 'fast'; choose one of: eager, sdpa, flash_attention_2, flex_attention" \
        in capsys.readouterr().err


@pytest.mark.parametrize("model_type, task, auto, built", [
    ("llama", None, "AutoModelForCausalLM", "LlamaForCausalLM"),
    ("whisper", None, "AutoModelForSpeechSeq2Seq", "WhisperForConditionalGeneration"),  # before its causal LM
    ("whisper", "seq2seq-lm", "AutoModelForSpeechSeq2Seq", "WhisperForConditionalGeneration"),  # the fallback
    ("bert", "question-answering", "AutoModelForQuestionAnswering", "BertForQuestionAnswering"),
    ("deit", "image-classification", "AutoModelForImageClassification", "DeiTForImageClassification"),  # 2 mapped
])
def test_the_class_built_follows_transformers_auto_tables(tmp_path, model_type, task, auto, built):
    """Without `architectures`, the class built is the one transformers' Auto class maps the model_type to (its
    `MODEL_FOR_*_MAPPING_NAMES`; for several, the first, as `auto_factory._get_model_class` picks): the class the
    Auto class itself builds from the same config; a model_type the task's Auto class does not map is a
    ModelLoadError naming the task."""
    import transformers

    def saved(model_type: str) -> str:
        config = transformers.AutoConfig.for_model(model_type)
        config.architectures = []  # none named (None: transformers 5.24's `_get_model_class` fails for a model_type
        config.save_pretrained(tmp_path / model_type)  # mapped to two classes, DeiT's; so does building it)
        return str(tmp_path / model_type / "config.json")

    path = saved(model_type)
    with torch.device("meta"):
        real = getattr(transformers, auto).from_config(transformers.AutoConfig.from_pretrained(path))
    loaded = loaded_model(RunSpec(path, batch=1, seq=8, task=task))
    assert type(loaded.model).__name__ == loaded.architecture == type(real).__name__ == built
    with pytest.raises(ModelLoadError, match="ctc head"):
        loaded_model(RunSpec(saved("bert"), batch=1, seq=8, task="ctc"))
