"""The patches of `vramtrace.bridges`: every target exists in the installed transformers and torch (so an upgrade
that removes one fails here), a missing target is a one-line BridgeError naming it and the installed version
(nothing patched), and every target is restored on exit, also when the step raises."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch
import transformers

from conftest import FIXTURES
from seam import loaded_model
from vramtrace import RunSpec, analyze, bridges, feature_bridges
from vramtrace.cli import main
from vramtrace.errors import BridgeError, VramtraceError
from vramtrace.spec import Device
from vramtrace.tracer.kernels import KernelPolicyMode
from vramtrace.tracer.recorder import StepRecorder

TINY_GPT2 = str(FIXTURES / "tiny-gpt2.json")
RAISING = [b for b in bridges.BRIDGES if not b.when_absent]
IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE (Include/object.h): a type whose attributes cannot be deleted


def _owner_and_name(module: str, attribute: str):
    owner = importlib.import_module(module)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _targets() -> dict[tuple[str, str], object]:
    """(module, attribute) -> current object, for every target, plus every transformers module's
    `maybe_autocast` binding (the bridge replaces those too). A target that is a bound method (an lru_cache's
    `cache_clear`) is a new object at each lookup: compare them with ==."""
    out = {}
    for b in bridges.BRIDGES:
        for module, attribute in b.targets:
            owner, name = _owner_and_name(module, attribute)
            out[module, attribute] = getattr(owner, name)
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("transformers") and hasattr(m, "maybe_autocast"):
            out[m.__name__, "maybe_autocast"] = m.maybe_autocast
    return out


def _installed():
    return bridges.installed(KernelPolicyMode(Device.CUDA, 90, torch.bfloat16), StepRecorder())


@pytest.mark.parametrize("bridge", bridges.BRIDGES, ids=lambda b: b.name)
def test_every_target_exists_in_the_installed_versions(bridge):
    assert bridge.written_for.split()[0] == bridge.library and bridge.why
    assert bridges.resolve(bridge) is not None, f"{bridge.name}: a target is gone; see its when_absent"
    for module, attribute in bridge.targets:
        owner, name = _owner_and_name(module, attribute)
        assert getattr(owner, name) is not None, (module, attribute)


@pytest.mark.parametrize("protocol,made", [
    (bridges.KernelPolicy, lambda: KernelPolicyMode(Device.CUDA, 90, torch.bfloat16)),
    (bridges.StepRecording, StepRecorder)], ids=["KernelPolicy", "StepRecording"])
def test_the_policy_and_the_recorder_offer_what_the_bridges_ask_of_them(protocol, made):
    obj = made()
    members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    assert members
    for name in members:
        assert hasattr(obj, name), f"{type(obj).__name__} has no {name} ({protocol.__name__})"
        wanted = vars(protocol).get(name)
        if inspect.isfunction(wanted):
            got = inspect.signature(getattr(obj, name)).parameters
            assert list(got) == list(inspect.signature(wanted).parameters)[1:], name


def test_every_target_is_patched_while_installed_and_restored_after_an_error():
    before = _targets()
    with pytest.raises(KeyError, match="inside the step"):
        with _installed():
            during = _targets()
            raise KeyError("inside the step")
    patched = {k for k in before if during[k] is not before[k]}
    for b in bridges.BRIDGES:
        # patched on the model instance (see test below), or per call from the kernel policy
        # (generation_questions: patched while a generation is traced, tests/test_generate.py; fsdp_on_meta:
        # while FSDP2 is applied and a sharded step traced, the test below; ddp_on_meta: on one DDP object);
        # a READ bridge's names are read, never patched
        if b.kind is bridges.BridgeKind.PATCH and b not in (
                bridges.CHECKPOINT_FUNCTION, bridges.FUNCTIONAL_TORCH_FUNCTION_CHECK, bridges.GENERATION_QUESTIONS,
                bridges.FSDP_ON_META, bridges.DDP_ON_META, bridges.FLASH_ATTENTION_STANDIN,
                bridges.PACKED_SEQUENCES) and b not in bridges.PIPELINE_BRIDGES:  # test_pipelining_unit.py
            assert (b.targets[0]) in patched, b.name
    assert all(k in patched for k in before if k[1] == "maybe_autocast")  # every module's binding
    after = _targets()
    assert all(after[k] == before[k] for k in before), [k for k in before if after[k] != before[k]]


def test_fsdp_on_meta_patches_every_target_and_restores_them_after_an_error():
    before = _targets()
    with pytest.raises(KeyError, match="inside"):
        with feature_bridges.fsdp_on_meta(StepRecorder()):
            during = _targets()
            raise KeyError("inside")
    assert all(during[t] is not before[t] for t in bridges.FSDP_ON_META.targets)
    after = _targets()
    assert all(after[k] == before[k] for k in before)


def test_flash_attention_standin_patches_every_target_and_restores_them_after_an_error():
    before = _targets()
    with pytest.raises(KeyError, match="inside"):
        with feature_bridges.flash_attention_standin(print, print):
            during = _targets()
            raise KeyError("inside")
    patched = {t for t in bridges.FLASH_ATTENTION_STANDIN.targets if during[t] is not before[t]}
    # _lazy_define_process_function, _pad_input and _unpad_input are read (the stand-in's kwargs and padding)
    assert patched == set(bridges.FLASH_ATTENTION_STANDIN.targets) - {
        (bridges._FA_UTILS, n) for n in ("_lazy_define_process_function", "_pad_input", "_unpad_input")}
    after = _targets()
    assert all(after[k] == before[k] for k in before)


def test_packed_sequences_answers_with_the_mask_inside_the_step_bridges_and_restores_after_an_error():
    from transformers import masking_utils

    before = _targets()
    positions = torch.empty((2, 8), dtype=torch.int64, device="meta")
    with pytest.raises(KeyError, match="inside"):
        with _installed():
            assert masking_utils.find_packed_sequence_indices(positions) is None  # PACKED_SEQUENCE_CHECK's answer
            with feature_bridges.packed_sequences():
                mask = masking_utils.find_packed_sequence_indices(positions)
                assert mask.shape == (2, 8) and mask.device.type == "meta"  # the real function's sequence indices
                raise KeyError("inside")
    after = _targets()
    assert all(after[k] == before[k] for k in before)


@pytest.mark.parametrize("bridge,target", [(b, t) for b in RAISING for t in b.targets],
                         ids=lambda x: x.name if isinstance(x, bridges.Bridge) else x[1])
def test_a_missing_target_is_a_bridge_error_and_nothing_is_patched(monkeypatch, bridge, target):
    module, attribute = target
    owner, name = _owner_and_name(module, attribute)
    before = _targets()
    if name in getattr(owner, "__dict__", {}) and not (isinstance(owner, type) and owner.__flags__ & IMMUTABLE_TYPE):
        monkeypatch.delattr(owner, name)
    else:  # of a C type (torch._C.StorageBase._cdata), or an lru_cache's method: gone as _lookup sees it
        lookup = bridges._lookup

        def without_target(m: str, a: str):
            if (m, a) == target:
                raise LookupError(a)
            return lookup(m, a)
        monkeypatch.setattr(bridges, "_lookup", without_target)
    library = importlib.import_module(bridge.library)
    with pytest.raises(BridgeError) as e:
        bridges.resolve(bridge)
    message = str(e.value)
    assert f"{module}.{attribute} is missing in {bridge.library} {library.__version__}" in message
    assert f"bridge {bridge.name}, written for {bridge.written_for}" in message and "\n" not in message
    if bridge is bridges.CHECKPOINT_FUNCTION:  # used when looking for the layer stack, not while tracing
        from vramtrace.tracer.checkpointing import layer_stack

        with pytest.raises(BridgeError, match=name):
            layer_stack(torch.nn.Sequential())
    elif bridge is bridges.GENERATION_QUESTIONS:  # installed around a traced model.generate()
        with pytest.raises(BridgeError, match=name):
            with feature_bridges.generating(3):
                pytest.fail("generating() went on without its target")
    elif bridge is bridges.DDP_ON_META:  # applied to one DDP object
        with pytest.raises(BridgeError, match=name):
            feature_bridges.ddp_on_meta(object())
    elif bridge in (bridges.INDUCTOR_GRAPHS, bridges.INDUCTOR_IR):  # checked before a torch.compile graph capture
        from vramtrace.tracer.compiled import capture

        with pytest.raises(BridgeError, match=name):
            capture(torch.nn.Linear(2, 2, device="meta"), {"input": torch.empty(1, 2, device="meta")})
    elif bridge is bridges.DTENSOR_PLAN_CACHES:  # cleared when a fake process group is destroyed
        from vramtrace.tracer.sharding import fake_rank

        with pytest.raises(BridgeError, match=name):
            with fake_rank(2, 0):
                pytest.fail("fake_rank() went on without its target")
    elif bridge is bridges.FSDP_ON_META:  # installed around fully_shard and a sharded step
        with pytest.raises(BridgeError, match=name):
            with feature_bridges.fsdp_on_meta(StepRecorder()):
                pytest.fail("fsdp_on_meta() went on without its target")
    elif bridge is bridges.PACKED_SEQUENCES:  # entered around a --packing step
        with pytest.raises(BridgeError, match=name):
            with feature_bridges.packed_sequences():
                pytest.fail("packed_sequences() went on without its target")
    elif bridge is bridges.FLASH_ATTENTION_STANDIN:  # entered around a flash_attention_2 build and step
        with pytest.raises(BridgeError, match=name):
            with feature_bridges.flash_attention_standin(print, print):
                pytest.fail("flash_attention_standin() went on without its target")
    elif bridge in bridges.PIPELINE_BRIDGES:  # entered around a --pp stage's step
        with pytest.raises(BridgeError, match=name):
            with feature_bridges.pipelining_on_meta(print, print):
                pytest.fail("pipelining_on_meta() went on without its target")
    else:
        with pytest.raises(BridgeError, match=name):
            with _installed():
                pytest.fail("installed() went on without its target")
    monkeypatch.undo()
    after = _targets()
    assert all(after[k] == before[k] for k in before), [k for k in before if after[k] != before[k]]


def test_a_missing_target_stops_analyze_and_the_cli_says_which(monkeypatch, capsys):
    from transformers import masking_utils

    monkeypatch.delattr(masking_utils, "fast_all")
    with pytest.raises(BridgeError, match="transformers.masking_utils.fast_all is missing in transformers"):
        analyze(RunSpec(TINY_GPT2, batch=1, seq=8))
    assert issubclass(BridgeError, VramtraceError)
    assert main([TINY_GPT2, "--batch", "1", "--seq", "8"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: transformers.masking_utils.fast_all is missing") and "\n" not in err


def test_a_target_whose_absence_is_not_needed(monkeypatch):
    monkeypatch.delattr(transformers.PreTrainedModel, "warn_if_padding_and_no_attention_mask")
    assert bridges.resolve(bridges.PADDING_WARNING) is None
    assert dict(bridges.status())["padding_warning"].startswith("not needed: ")
    with _installed():
        assert not hasattr(transformers.PreTrainedModel, "warn_if_padding_and_no_attention_mask")


def test_checkpoint_functions_are_routed_or_the_error_names_the_attribute():
    model = loaded_model(RunSpec(TINY_GPT2, batch=1, seq=8)).model
    with pytest.raises(BridgeError, match="_gradient_checkpointing_func on GPT2LMHeadModel's modules"):
        feature_bridges.route_checkpoint_functions(model, lambda *a, **k: None)  # checkpointing not enabled
    model.activation_checkpointing_enable({"use_reentrant": False})
    marker = lambda *a, **k: None  # noqa: E731
    n = feature_bridges.route_checkpoint_functions(model, marker)
    layers = [m for m in model.modules() if getattr(m, "_gradient_checkpointing_func", None) is marker]
    assert n == len(layers) >= model.config.n_layer


def test_a_patched_inherited_method_is_removed_again_not_copied_onto_the_class():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    with bridges._set(Child, "f", lambda self: "bridged"):
        assert Child().f() == "bridged"
    assert "f" not in vars(Child) and Child().f() == "base"
    with pytest.raises(RuntimeError):
        with bridges._set(Base, "f", lambda self: "bridged"):
            raise RuntimeError
    assert Base().f() == "base"


def test_the_grad_scaler_state_is_its_scale_and_growth_tracker_or_a_bridge_error(monkeypatch):
    scaler = torch.amp.GradScaler("cpu")
    scaled = scaler.scale(torch.ones(()))
    scale, tracker = feature_bridges.grad_scaler_state(scaler)
    assert scaled.item() == scale.item() == 2.0 ** 16 and tracker.dtype == torch.int32 and tracker.item() == 0
    monkeypatch.setattr(torch.amp.GradScaler, "_lazy_init_scale_growth_tracker", lambda self, dev: None)
    with pytest.raises(BridgeError, match=r"the assignment of self\._scale in torch\.amp\.grad_scaler\.GradScaler\."
                                          "_lazy_init_scale_growth_tracker is missing in torch"):
        feature_bridges.grad_scaler_state(scaler)
    with pytest.raises(BridgeError, match="self._scale"):
        with _installed():
            pytest.fail("installed() went on without the scaler's state")
