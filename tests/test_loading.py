"""Model references: bundled configs with exact parameter counts, local paths, params.json, clear errors."""

import json

import pytest

from seam import loaded_model
from vramtrace import RunSpec
from vramtrace.errors import ModelLoadError
from vramtrace.tracer.loading import meta_params_to_hf, resolve_config

# Published parameter counts (model cards / the issue), not computed by vramtrace.
EXPECTED = {
    "meta-llama/Llama-2-7b": 6_738_415_616,
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-13b": 13_015_864_320,
    "meta-llama/Llama-2-70b": 68_976_648_192,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "gpt2": 124_439_808,
    "bert-base-uncased": 109_514_298,
}


@pytest.mark.parametrize("ref", sorted(EXPECTED))
def test_bundled_param_counts_exact(ref):
    assert resolve_config(ref).source == "bundled"
    assert loaded_model(RunSpec(ref, 1, 8)).params == EXPECTED[ref]


def test_meta_params_json_llama2_7b():
    cfg = meta_params_to_hf({"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05,
                             "vocab_size": -1})
    assert cfg["intermediate_size"] == 11008 and cfg["vocab_size"] == 32000


def test_local_dir_and_params_json(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps(
        {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-05, "vocab_size": -1}))
    assert resolve_config(str(tmp_path)).source == "local"
    assert loaded_model(RunSpec(str(tmp_path), 1, 8)).params == EXPECTED["meta-llama/Llama-2-7b"]


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"model_type": "no-such-arch"}', "unknown model_type"),
    ('{"hidden_size": 8}', "no model_type"),
])
def test_bad_configs(tmp_path, content, needle):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(ModelLoadError, match=needle):
        loaded_model(RunSpec(str(p), 1, 8))


def test_remote_code_refused_without_flag(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "evil.Config"}}))
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        loaded_model(RunSpec(str(p), 1, 8))


def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_config("./no/such/config.json")


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="local"):
        resolve_config("some-org/surely-not-cached-model-xyz")


@pytest.mark.parametrize("ref,params", [
    ("mistralai/Mixtral-8x7B-v0.1", 46_702_792_704),  # the figures
    ("Qwen/Qwen2.5-7B", 7_615_616_512),
    ("meta-llama/Llama-3.1-405B", 405_853_388_800),  # Meta's model card: 405.85B
    ("google/gemma-2-9b", 9_241_705_984),
    ("t5-base", 222_903_552),
    ("google/vit-base-patch16-224", 86_567_656),
    ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200),
])
def test_bundled_parameter_counts(ref, params):
    assert loaded_model(RunSpec(ref, batch=1, seq=8)).params == params
