"""Custom architectures: `path/to/model.py:NAME` or `package.module:NAME`, built with no arguments.

NAME is an `nn.Module` subclass or a function returning an `nn.Module`. It is built under `torch.device(...)`
(the meta device for a trace: no weights, no memory; the CPU or CUDA for a real run, seeded with 0 by
`building.load_model`).

Inputs, in this order of precedence:
1. `--input NAME=DTYPE[DIMS][:LO..HI]` (repeatable): keyword arguments when every NAME is a parameter of the
   module's `forward`, else positional arguments in the order given (e.g. `nn.Sequential`'s `input`);
2. `example_inputs(batch, seq)` defined in the file: a tuple or list (positional arguments), a dict (keyword
   arguments) or a single tensor; each entry a tensor or a shape spec string `DTYPE[DIMS][:LO..HI]`.
   It is called under the same `torch.device(...)` as the model, so factory calls land on meta in a trace.

The training loss, in this order:
1. `loss(output, *inputs)` defined in the file (inputs: positional ones, then keyword ones in order);
2. `output.loss`, or `output["loss"]`;
3. `output.mean()` of the first tensor in the output (pytree order), e.g. a classifier's logits.

Importing the file runs it: vramtrace does this only for a file the user names on the command line.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ModelLoadError, TraceError, UsageError
from ..custom_inputs import IN_PROCESS_LOCATION, InProcessModel, InputSpec, custom_ref
from ..spec import RunSpec


@dataclass(slots=True)
class CustomModel:
    """A built custom module with its step inputs and its loss. `location`: the file or module it came from."""

    model: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]
    loss: Callable[[Any], torch.Tensor]
    location: str
    held: dict[str, torch.Tensor] = field(default_factory=dict)  # alive through the step, not passed to the model


def in_process_model(module: torch.nn.Module, inputs: Any = None, loss: Callable | None = None,
                     held: dict | None = None) -> InProcessModel:
    """The `InProcessModel` carrying `module`, an `nn.Module` the caller built on the meta device (`with
    torch.device("meta"): model = MyModel()`), for `RunSpec.model`: the tracer builds it like a file's NAME, each
    build a deep copy (the caller's module is never changed). `inputs`, as `example_inputs` would return them: a
    dict (keyword arguments), a tuple or list (positional) or one tensor; each a meta tensor or a shape spec string
    "DTYPE[DIMS][:LO..HI]" (B and S: --batch and --seq). `loss(output, *inputs)`: the training loss (default:
    `output.loss`, else the mean of the first output tensor). `held`: meta tensors or shape specs by name that the
    caller's loop keeps alive through the step besides the inputs (counted from the step's start, never passed to
    the model). Raises
    UsageError when `module` is not an nn.Module, has tensors off the meta device, `inputs` is None or `held`
    holds anything but meta tensors."""
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"model= takes an nn.Module or a model reference string, not a {type(module).__name__}")
    off_meta = [(n, t.device) for n, t in [*module.named_parameters(), *module.named_buffers()]
                if t.device.type != "meta"]
    if off_meta:
        raise UsageError(f"the module's {off_meta[0][0]} is on {off_meta[0][1]}: build it on the meta device "
                         "(with torch.device('meta'): model = MyModel()), so that no weights are allocated")
    if inputs is None:
        raise UsageError("analyze(model=<module>) needs inputs=: a dict of keyword arguments, a tuple of positional "
                         "ones or one tensor (meta tensors, or shape specs such as 'int64[B,S]:0..32000')")
    if held and any(not isinstance(t, str) and (not isinstance(t, torch.Tensor) or t.device.type != "meta")
                    for t in held.values()):
        raise UsageError("held= takes meta tensors or shape specs such as 'int64[B,S]' by name")
    return InProcessModel(module, inputs, loss, dict(held) if held else None)


def _in_process_namespace(carried: InProcessModel) -> types.SimpleNamespace:
    """A namespace standing for a file that defines the carried module's NAME (a deep copy per build),
    `example_inputs` and, when given, `loss`."""
    namespace = {carried.name: lambda: copy.deepcopy(carried.module),
                 "example_inputs": lambda batch, seq: carried.inputs}
    if carried.loss is not None:
        namespace["loss"] = carried.loss
    return types.SimpleNamespace(**namespace, __name__=IN_PROCESS_LOCATION)


def import_target(target: str, fresh: bool = False):
    """Import `target`: a `.py` file path or a dotted module name (found from the current directory too, as
    `python -m` would). A file is imported once per process, or anew
    with `fresh` (its module globals start empty: a --step file's EMA copy). Raises ModelLoadError when it cannot
    be found or raises while importing."""
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ModelLoadError(f"custom module file {target} does not exist; pass path/to/model.py:NAME")
        name = f"vramtrace_custom_{path.stem}_{abs(hash(str(path)))}"
        if name in sys.modules and not fresh:  # imported once per process (a file may register ops or classes)
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module  # dataclasses and pickling look modules up here
        sys.path.insert(0, str(path.parent))  # its sibling imports, as `python model.py` finds them
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:
            sys.modules.pop(name, None)
            raise ModelLoadError(f"importing {target} failed: {type(e).__name__}: {_first_line(e)}") from e
        finally:
            sys.path.remove(str(path.parent))
        return module
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise ModelLoadError(f"cannot import module {target!r} ({_first_line(e)}); pass path/to/model.py:NAME or "
                             "run from the directory that holds the package") from e
    except Exception as e:
        raise ModelLoadError(f"importing {target} failed: {type(e).__name__}: {_first_line(e)}") from e
    finally:
        sys.path.remove(os.getcwd())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _make_input(spec: InputSpec, batch: int, seq: int | None, device: str) -> torch.Tensor:
    shape = spec.shape(batch, seq)
    dtype = getattr(torch, spec.dtype)
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    low, high = spec.value_range
    t = torch.randint(low, high, shape, dtype=torch.int64 if dtype is torch.bool else dtype, device=device)
    return t.bool() if dtype is torch.bool else t


def _as_input(value, where: str, batch: int, seq: int | None, device: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if device == "meta" and value.device.type != "meta":
            return torch.empty_like(value, device="meta")
        return value.to(device) if device != "meta" else value
    if isinstance(value, str):
        return _make_input(InputSpec.parse(value, need_name=False), batch, seq, device)
    raise ModelLoadError(f"{where} must be a tensor or a shape spec such as 'float32[B,3,224,224]', "
                         f"got {type(value).__name__}")


def output_loss(output) -> torch.Tensor:
    """The training loss of a model output: `.loss` / `["loss"]`, else `.mean()` of its first floating-point
    tensor. Raises TraceError when there is none."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    for leaf in torch.utils._pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.mean()
    raise TraceError("the model's output holds no floating-point tensor to take .mean() of; define "
                     "loss(output, *inputs) in the model file")


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def build_custom(spec: RunSpec, device: str, dtype: torch.dtype | None) -> CustomModel:
    """Build the custom module of `spec.model` on `device` ('meta', 'cpu', 'cuda') with its inputs and loss.
    `dtype`: cast the floating-point parameters and buffers to it (pure bf16/fp16), None: as built.
    Raises ModelLoadError (import, build or input problems), UsageError (an input needs --seq)."""
    ref = custom_ref(spec.model)
    assert ref is not None
    target, name = ref
    carried = spec.in_process
    module = import_target(target) if carried is None else _in_process_namespace(carried)
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, torch.nn.Module) and v.__module__ == module.__name__)
        raise ModelLoadError(f"{target} defines no {name!r}" + (f"; its nn.Module classes: {', '.join(found)}" if found else ""))
    if not callable(obj):
        raise ModelLoadError(f"{target}:{name} is a {type(obj).__name__}, not an nn.Module class or a function")
    try:
        with torch.device(device):
            model = obj()
    except Exception as e:
        raise ModelLoadError(f"building {name}() from {target} failed: {type(e).__name__}: {_first_line(e)} "
                             f"({name} must be built with no arguments, or be a function returning an nn.Module)") from e
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"{target}:{name}() returned a {type(model).__name__}, not an nn.Module")
    if dtype is not None:
        model = model.to(dtype)
    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, torch.Tensor] = {}
    if spec.inputs:
        made = {s.name: _make_input(s, spec.batch, spec.seq, device) for s in map(InputSpec.parse, spec.inputs)}
        if set(made) <= _forward_parameters(model):
            kwargs = made
        else:  # e.g. nn.Sequential's forward(input): the names are labels, the order is the call's
            args = tuple(made.values())
    elif callable(getattr(module, "example_inputs", None)):
        try:
            with torch.device(device):
                value = module.example_inputs(spec.batch, spec.seq)
        except UsageError:
            raise
        except Exception as e:
            hint = " (it got seq=None: pass --seq)" if spec.seq is None else ""
            raise ModelLoadError(f"example_inputs({spec.batch}, {spec.seq}) in {target} failed: "
                                 f"{type(e).__name__}: {_first_line(e)}{hint}") from e
        if isinstance(value, dict):
            kwargs = {k: _as_input(v, f"example_inputs()[{k!r}]", spec.batch, spec.seq, device) for k, v in value.items()}
        else:
            values = value if isinstance(value, (tuple, list)) else (value,)
            args = tuple(_as_input(v, f"example_inputs()[{i}]", spec.batch, spec.seq, device) for i, v in enumerate(values))
    else:
        raise ModelLoadError(f"{target}:{name} needs inputs: pass --input NAME=DTYPE[DIMS] (e.g. --input "
                             f"x=float32[B,3,224,224]) or define example_inputs(batch, seq) in {target}")
    user_loss = getattr(module, "loss", None)
    if callable(user_loss):
        inputs = args + tuple(kwargs.values())

        def loss(output):
            value = user_loss(output, *inputs)
            if not isinstance(value, torch.Tensor):
                raise TraceError(f"loss() in {target} returned a {type(value).__name__}, not a tensor")
            return value
    else:
        loss = output_loss
    held = {n: _as_input(v, f"held[{n!r}]", spec.batch, spec.seq, device)
            for n, v in ((carried.held or {}) if carried is not None else {}).items()}
    return CustomModel(model, args, kwargs, loss, target, held)
