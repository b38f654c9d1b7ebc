"""`vramtrace --from FILE` (vramtrace.sources, issue 41): each example file of the projects (copied with their
origin in docs/research/issue-41-examples/) gives the run it describes. Expected values are read from the file
itself here (yaml/json) with the project's rule written out in the test (the research doc's sections 1-4), never
taken from vramtrace's reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from conftest import FIXTURES, run_cli
from vramtrace.errors import UsageError
from vramtrace.sources import SourceFormat, Target, read_source, spec_from

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "research" / "issue-41-examples"
TINY = str(FIXTURES / "tiny-llama-gqa.json")
H100 = Target(cuda=True, bf16=True)
T4 = Target(cuda=True, bf16=False)  # sm75: no bf16, axolotl's `bf16: auto` turns to fp16


# the axolotl keys issue 41 lists
AXOLOTL_KEYS = {"base_model", "model_type", "load_in_4bit", "load_in_8bit", "adapter", "lora_r", "lora_alpha",
                "lora_dropout", "lora_target_modules", "lora_target_linear", "sequence_len", "sample_packing",
                "micro_batch_size", "gradient_accumulation_steps", "optimizer", "bf16", "fp16", "tf32",
                "gradient_checkpointing", "flash_attention", "sdp_attention", "deepspeed", "fsdp", "fsdp_config"}


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


def _settings(source) -> dict:
    return {e.option: e.value for e in source.settings}


def _examples(folder: str) -> list[Path]:
    return sorted((EXAMPLES / folder).glob("*.y*ml")) + sorted((EXAMPLES / folder).glob("*.json"))


@pytest.mark.parametrize("path", _examples("axolotl"), ids=lambda p: p.name)
def test_axolotl_examples(path):
    data, source = _load(path), read_source(path, H100)
    got = _settings(source)
    assert source.format is SourceFormat.AXOLOTL and source.model == data["base_model"]
    assert got["batch"] == data["micro_batch_size"] and got["grad_accum"] == data["gradient_accumulation_steps"]
    assert got["seq"] == 64 * math.ceil(data["sequence_len"] / 64)  # the collator pads to a multiple of 64
    assert got["optimizer"] == data["optimizer"] and got["attn_implementation"] == data["attn_implementation"]
    assert got["precision"] == "bf16-autocast"  # bf16: auto on a bf16 GPU: weights loaded in bf16, autocast
    assert got.get("packing", False) == bool(data["sample_packing"])
    assert got["clip_grad_norm"] == data.get("max_grad_norm", 1.0)
    reentrant = (data.get("gradient_checkpointing_kwargs") or {}).get("use_reentrant", False)
    assert got["checkpointing"] == ("layers:reentrant" if reentrant else "layers")
    assert got.get("quantization") == ("nf4" if data.get("load_in_4bit") else None)
    if data.get("adapter"):
        assert (got["lora_rank"], got["lora_alpha"]) == (data["lora_r"], data["lora_alpha"])
        assert got["lora_dropout"] == data["lora_dropout"]
        targets = ("all-linear",) if data.get("lora_target_linear") else tuple(data["lora_target_modules"])
        assert got["lora_targets"] == targets
    else:
        assert "lora_rank" not in got
    assert got["recipe"] == "axolotl" and got["use_cache"] is False
    # the keys issue 41 names are read, never reported as unknown (load_in_8bit: false was, once)
    unknown = [w for w in source.warnings if "not a key vramtrace's axolotl reader knows" in w]
    assert not [w for w in unknown if w.split(": ")[1] in AXOLOTL_KEYS], unknown
    assert read_source(path, T4).settings and _settings(read_source(path, T4))["precision"] == "fp16-autocast"


def test_axolotl_fsdp_example_is_warned_as_axolotl_refuses_it():
    source = read_source(EXAMPLES / "axolotl" / "llama-2__qlora-fsdp.yml", H100)
    assert any("top-level fsdp list is rejected by axolotl 0.21" in w for w in source.warnings)
    assert any("fsdp_config: FSDP2 over the launch's N GPUs" in w and "--cpu-offload" in w for w in source.warnings)
    assert "fsdp" not in _settings(source)


@pytest.mark.parametrize("path", _examples("llamafactory"), ids=lambda p: p.name)
def test_llamafactory_examples(path):
    data, source = _load(path), read_source(path, H100)
    got = _settings(source)
    assert source.format is SourceFormat.LLAMAFACTORY and source.model == data["model_name_or_path"]
    assert got["batch"] == data["per_device_train_batch_size"]
    assert got["grad_accum"] == data["gradient_accumulation_steps"]
    assert got["seq"] == 8 * math.ceil(data["cutoff_len"] / 8)  # sft collator: pad_to_multiple_of=8
    assert got["checkpointing"] == "layers:reentrant"  # on by default, use_reentrant_gc True
    assert got["optimizer"] == "adamw_torch_fused" and got["clip_grad_norm"] == 1.0  # TrainingArguments' defaults
    full = data["finetuning_type"] == "full"
    assert got["precision"] == ("bf16-mixed" if full else "bf16-autocast")
    if not full:
        assert got["lora_rank"] == data["lora_rank"] and got["lora_alpha"] == 2 * data["lora_rank"]
        assert got["lora_targets"] == ("all-linear",) and data["lora_target"] == "all"
    assert got.get("quantization") == ("nf4" if data.get("quantization_bit") == 4 else None)
    if data.get("quantization_bit"):
        assert got["double_quant"] is True and got["bnb_compute_dtype"] == "bf16"
    assert any("deepspeed: the DeepSpeed config it names is not read from here" in w for w in source.warnings) == ("deepspeed" in data)
    assert "packing" not in got and "attn_implementation" not in got  # packing None for sft; flash_attn auto


@pytest.mark.parametrize("path", _examples("transformers"), ids=lambda p: p.name)
def test_training_arguments_examples(path):
    data, source = _load(path), read_source(path, H100)
    got = _settings(source)
    assert source.format is SourceFormat.TRAINING_ARGUMENTS and source.model is None and "seq" not in got
    assert got["batch"] == data["per_device_train_batch_size"]
    assert got["grad_accum"] == data["gradient_accumulation_steps"]
    assert got["optimizer"] == data["optim"] and got["clip_grad_norm"] == data["max_grad_norm"]
    # the Trainer pops every_n_layers and offload and passes the rest, or None (non-reentrant) when nothing is
    # left (transformers 5.24 trainer.py:1503-1528 `gc_kwargs or None`); a rest without use_reentrant: torch's True
    rest = {k: v for k, v in (data["activation_checkpointing_kwargs"] or {}).items()
            if k not in ("every_n_layers", "offload")}
    expected = ("none" if not data["activation_checkpointing"] else
                "layers" if not rest or rest.get("use_reentrant", True) is False else "layers:reentrant")
    if (data.get("fsdp_config") or {}).get("activation_checkpointing"):
        expected = "layers"  # FSDP's own checkpoint wrapper
    assert got["checkpointing"] == expected
    assert "precision" not in got and any("bf16 and fp16 are false" in w for w in source.warnings)
    assert any("fsdp: FSDP over the launch's N GPUs" in w for w in source.warnings) == bool(data["fsdp"])


@pytest.mark.parametrize("path", _examples("accelerate"), ids=lambda p: p.name)
def test_accelerate_examples(path):
    data, source = _load(path), read_source(path, H100)
    got = _settings(source)
    config = data["fsdp_config"]
    assert source.format is SourceFormat.ACCELERATE and data["distributed_type"] == "FSDP"
    assert got["fsdp"] == data["num_processes"] and got["precision"] == f"{data['mixed_precision']}-mixed"
    assert got["reshard_after_forward"] is (config.get("fsdp_reshard_after_forward") is True
                                            or config.get("fsdp_sharding_strategy") == "FULL_SHARD")
    assert got.get("cpu_offload", False) is config["fsdp_offload_params"]
    fsdp1 = "fsdp_version" not in config  # accelerate launch's default is FSDP1
    assert any("accelerate launches FSDP1" in w for w in source.warnings) == fsdp1


def test_overrides_beat_files_and_later_files_beat_earlier(tmp_path):
    qlora = EXAMPLES / "axolotl" / "llama-3__qlora-1b.yml"
    spec = spec_from(qlora, model=TINY, batch=1, device="cpu", attn_implementation="sdpa")
    assert spec.batch == 1 and all(e.option != "batch" for e in spec.sources)
    later = tmp_path / "later.yml"
    later.write_text("micro_batch_size: 3\nsequence_len: 100\nbase_model: other/model\n")
    spec = spec_from(qlora, later, model=TINY, device="cpu", attn_implementation="sdpa")
    assert (spec.batch, spec.seq) == (3, 128)
    assert {e.option: e.file for e in spec.sources}["batch"] == "later.yml"
    assert spec.model == TINY and all(e.option != "model" for e in spec.sources)


def test_detection_failure_names_the_file_and_the_formats(tmp_path):
    odd = tmp_path / "odd.yml"
    odd.write_text("learning_rate: 0.1\nfoo: 1\n")
    with pytest.raises(UsageError, match=r"cannot tell the format of --from .*odd\.yml: it is none of an axolotl "
                                         r"YAML .* a LLaMA-Factory YAML .* TrainingArguments JSON .* accelerate"):
        read_source(odd)
    listing = tmp_path / "list.yml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="holds no mapping of keys"):
        read_source(listing)


def test_axolotl_deprecated_flash_attention_flag(tmp_path):
    old = tmp_path / "old.yml"
    old.write_text("base_model: x/y\nflash_attention: true\n")
    source = read_source(old)
    assert _settings(source)["attn_implementation"] == "flash_attention_2"
    assert any("flash_attention: deprecated in axolotl 0.21" in w for w in source.warnings)
    old.write_text("base_model: x/y\nflash_attention: true\nattn_implementation: sdpa\n")
    with pytest.raises(UsageError, match="axolotl 0.21 refuses that"):
        read_source(old)


def test_warnings_for_deepspeed_and_memory_keys(tmp_path):
    cfg = tmp_path / "ds.yml"
    cfg.write_text("base_model: x/y\ndeepspeed: deepspeed_configs/zero2.json\nliger_rms_norm: true\n"
                   "some_future_key: 3\nlearning_rate: 0.1\nwandb_project: p\n")
    warnings = read_source(cfg).warnings
    assert "ds.yml: deepspeed: the DeepSpeed config it names is not read from here: pass it as --deepspeed FILE " \
           "with --dp N (docs/zero.md); the prediction is for one GPU without ZeRO" in warnings
    assert any(w.startswith("ds.yml: liger_rms_norm: True changes memory") for w in warnings)
    assert any(w.startswith("ds.yml: some_future_key: not a key vramtrace's axolotl reader knows") for w in warnings)
    assert not any("learning_rate" in w or "wandb_project" in w for w in warnings)  # harmless keys: quiet
    assert len(warnings) == 3


def test_axolotl_lora_without_rank_is_refused(tmp_path):
    cfg = tmp_path / "lora.yml"
    cfg.write_text("base_model: x/y\nadapter: lora\n")
    with pytest.raises(UsageError, match="adapter lora without lora_r; axolotl has no default rank"):
        read_source(cfg)


def test_peft_all_linear_is_axolotls_lora_target_linear():
    """peft's "all-linear" (what the readers emit for axolotl's lora_target_linear and LLaMA-Factory's
    lora_target: all) adapts the modules axolotl's `find_all_linear_names` names: every Linear but lm_head."""
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY))
    axolotl_rule = {name.split(".")[-1] for name, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear)} - {"lm_head"}
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear"))
    adapted = {name.split(".")[-1] for name in peft_model.peft_config["default"].target_modules}
    assert adapted == axolotl_rule and "lm_head" not in adapted


def test_cli_from_training_arguments_end_to_end(tmp_path, capsys):
    args = {"output_dir": "out", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
            "optim": "adamw_torch", "max_grad_norm": 0.5, "gradient_checkpointing": True, "learning_rate": 1e-4}
    ta = tmp_path / "args.json"
    ta.write_text(json.dumps(args))
    r = run_cli(capsys, TINY, "--from", ta, "--seq", "16", "--device", "cpu", "--precision", "fp32",
                "--grad-accum", "1", "--json", "-")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["run"]
    assert (run["batch"], run["seq"], run["grad_accum"]) == (2, 16, 1)  # --grad-accum typed: it wins
    assert run["checkpointing"] == "layers" and run["clip_grad_norm"] == 0.5 and run["use_cache"] is False
    sources = {s["option"]: s for s in run["sources"]}
    assert sources["batch"] == {"option": "batch", "value": 2, "file": "args.json",
                                "key": "per_device_train_batch_size"}
    assert "grad_accum" not in sources and "precision" not in sources and r.stderr == ""
    accelerate = tmp_path / "acc.yml"  # a later file sets the precision the first one left open
    accelerate.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\n")
    r = run_cli(capsys, TINY, "--from", ta, "--from", accelerate, "--seq", "16", "--device", "cpu", "--json", "-")
    run = json.loads(r.stdout)["run"]
    assert run["precision"] == "bf16-mixed" and run["precision_source"] == "--from acc.yml (mixed_precision)"
    assert {"option": "precision", "value": "bf16-mixed", "file": "acc.yml", "key": "mixed_precision"} in run["sources"]
    assert r.stderr == ""  # args.json's warning about its precision is moot: acc.yml sets it
    r = run_cli(capsys, "--from", ta, "--device", "cpu")
    assert r.returncode == 2
    assert r.stderr == ("Error: the --from files give no MODEL and no --seq (TrainingArguments and accelerate files "
                        "hold neither): add MODEL and --seq on the command line\n")


def test_llamafactory_under_an_accelerate_fsdp2_launch_checkpoints_non_reentrant():
    """LLaMA-Factory's checkpointing.py forces use_reentrant_gc False when accelerate launches FSDP2
    (FSDP_VERSION=2); an FSDP1 launch (no fsdp_version) keeps its reentrant default."""
    lora = EXAMPLES / "llamafactory" / "train_lora__qwen3_lora_sft.yaml"
    fsdp2 = EXAMPLES / "accelerate" / "llamafactory__fsdp2_config.yaml"
    fsdp1 = EXAMPLES / "accelerate" / "llamafactory__fsdp_config.yaml"
    assert _load(fsdp2)["fsdp_config"]["fsdp_version"] == 2 and "fsdp_version" not in _load(fsdp1)["fsdp_config"]
    spec = spec_from(lora, fsdp2, model=TINY, device="cpu")
    assert str(spec.checkpointing) == "layers" and spec.fsdp == _load(fsdp2)["num_processes"]
    assert str(spec_from(lora, fsdp1, model=TINY, device="cpu").checkpointing) == "layers:reentrant"


@pytest.mark.parametrize("text,message", [
    ("base_model: x\nadapter: lora\nlora_r: abc\n", "lora_r: 'abc' is not a valid value for axolotl's lora_r"),
    ("base_model: x\nadapter: qlora\nlora_r: 8\n", "adapter qlora needs load_in_4bit: true"),
    ("distributed_type: FSDP\nnum_processes: two\nfsdp_config: {fsdp_version: 2}\n",
     "num_processes: 'two' is not a valid value for accelerate's num_processes"),
])
def test_a_bad_value_in_a_file_is_a_one_line_usage_error(tmp_path, text, message):
    path = tmp_path / "run.yml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_source(path, H100)


def test_training_arguments_kwargs_with_only_the_trainers_own_keys_checkpoint_non_reentrant(tmp_path):
    """{"every_n_layers": 1} leaves nothing for torch: the Trainer passes None, non-reentrant (trainer.py
    1503-1528); {"preserve_rng_state": True} leaves use_reentrant to torch 2.13's default, True."""
    base = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "optim": "adamw_torch",
            "activation_checkpointing": True, "bf16": False, "fp16": False}
    got = []
    for kwargs in ({}, {"every_n_layers": 1}, {"preserve_rng_state": True}):
        path = tmp_path / "args.json"
        path.write_text(json.dumps(base | {"activation_checkpointing_kwargs": kwargs}))
        got.append(_settings(read_source(path, H100))["checkpointing"])
    assert got == ["layers", "layers", "layers:reentrant"]


def test_llamafactory_lora_target_may_be_a_yaml_list(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text("model_name_or_path: x\nstage: sft\nfinetuning_type: lora\nlora_target: [q_proj, v_proj]\n"
                    "cutoff_len: 64\n")
    assert _settings(read_source(path, H100))["lora_targets"] == ("q_proj", "v_proj")
