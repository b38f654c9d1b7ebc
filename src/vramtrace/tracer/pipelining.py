"""Pipeline parallelism (`--pp P`): one stage of `torch.distributed.pipelining` traced on a fake rank of P.

The model built on meta is cut as users of `torch.distributed.pipelining` cut an HF decoder by hand (manual
`PipelineStage`s, torchtitan's way): stage 0 = the input embedding and its decoder layers, a middle stage its
layers, the last stage its layers, the final norm and the head; every stage keeps its own rotary embedding and
computes (cos, sin) from `position_ids = arange(seq)` for each micro-batch (what `LlamaModel.forward` does once per
forward, transformers/models/llama/modeling_llama.py). Only the hidden states cross stages; no attention mask is
passed (sdpa then runs `is_causal=True`, transformers/integrations/sdpa_attention.py). Tied embeddings become two
parameters, one per end (each stage holds its own module). Layers per stage: `--pp-split`, else an even split with
the remainder on the earliest stages (`even_split`).

Each stage `k` is traced alone, inside `sharding.fake_rank(P, k)`: a real `PipelineStage` in static metadata mode
(its `input_args` a meta tensor with the dtype and `requires_grad` of the previous stage's real output, found by a
meta forward of the stages before it: `hidden_meta`), the real schedule class (`ScheduleGPipe`, `Schedule1F1B`:
their own order of micro-steps, their receive buffers, their defaults `scale_grads=True` and
`return_outputs=True`), the loss `model.loss_function` with the vocabulary size given as `loss_fn`, and the loop
of one rank (`pipeline_step`): `out = schedule.step(...)`, `del out`, `optimizer.step()`, `optimizer.zero_grad()`,
each stage with its own optimizer of the spec's kind (none for a stage without parameters). The recorder records
it like any step (`trace._record_on` with this step function), so the liveness analysis, categories and kernel
rules apply unchanged. The bridges `PIPELINE_P2P` (a completed stand-in Work holding its ops' tensors, as gloo's
Work does) and `PIPELINE_STATIC_VOTE` (the warm-up vote's answer when every stage was given its metadata) let the
schedule run on meta with the fake group; `PIPELINE_MICRO_STEPS` labels each forward and backward micro-step.

Interleaved 1F1B (`ScheduleInterleaved1F1B`, V = `spec.pp_virtual_stages` stages per rank): the model is cut into
P × V stages and rank r holds stages r, r + P, ... (`rank_stages`), each a static `PipelineStage` as above, cut
from one copy of the model (`cut_rank`: a `RankModule`, whose stages share what the model shares, the rotary
module); the schedule is given the list of them, and the rank has one optimizer over all their parameters. A
rank is then what is traced and reported (`spec.stage` names the rank). Zero bubble (`ScheduleInterleavedZeroBubble`)
the same way, its backward split into input-gradient and weight-gradient micro-steps (`W<i>@<k>`).

Checked against real multi-process gloo runs (docs/research/issue-42-pipelining.md: every stage's peak to the
byte, fp32, GPipe and 1F1B, P = 2..4, uneven splits and a 0-layer stage; interleaved-1f1b every rank to the byte
for Llama, P = 2 and 3; tests/test_pipelining.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..analysis.categories import Category
from ..errors import UsageError
from ..spec import PipelineSchedule, RunSpec, ZeroGrad


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Decoder layers per stage: `layers // stages` each, the remainder one each on the earliest stages (what
    torchtitan's `pipeline_module_split` does for an even split)."""
    return tuple(layers // stages + (1 if k < layers % stages else 0) for k in range(stages))


def stage_split(spec: RunSpec, num_layers: int) -> tuple[int, ...]:
    """The layers of each of the P × V stages (`spec.pp` ranks of `spec.pp_virtual_stages` stages each; V is 1
    but under interleaved-1f1b): `spec.pp_split` (checked to sum to `num_layers`), else `even_split`. Raises
    UsageError when the split does not add up."""
    if spec.pp_split is None:
        return even_split(num_layers, spec.pp * spec.pp_virtual_stages)
    if sum(spec.pp_split) != num_layers:
        raise UsageError(f"--pp-split {','.join(map(str, spec.pp_split))} gives {sum(spec.pp_split)} decoder layers; "
                         f"the model has {num_layers}: make the split sum to {num_layers}")
    return tuple(spec.pp_split)


def stage_classes(split: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The stages grouped by the modules they hold: the first and the last stage each alone (the embedding, the
    head and the loss), middle stages with the same number of layers together (the same layers and the same
    receive and send buffers). Whether they also run the same schedule: `distinct_stages`."""
    groups: dict[tuple, list[int]] = {}
    last = len(split) - 1
    for k, n in enumerate(split):
        key = ("first",) if k == 0 else ("last",) if k == last else ("middle", n)
        groups.setdefault(key, []).append(k)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def rank_stages(rank: int, ranks: int, virtual: int) -> tuple[int, ...]:
    """The stages rank `rank` of `ranks` holds with `virtual` stages per rank: rank, rank + P, ..., rank + (V - 1)
    P (torch's loop placement: schedules.py `ScheduleInterleaved1F1B._calculate_single_rank_operations`,
    `forward_stage_index` = local index × P + rank)."""
    return tuple(rank + v * ranks for v in range(virtual))


def distinct_stages(split: tuple[int, ...], schedule: PipelineSchedule, micro_batches: int,
                    ranks: int) -> list[tuple[int, ...]]:
    """The stages that run the same program, grouped (`stage_classes`), refined by the schedule: under 1F1B
    stage k warms up min(M, P - k) forwards (torch/distributed/pipelining/schedules.py `Schedule1F1B`
    `_step_microbatches`: `warmup_chunks`), so middle stages share a program only when that count is the same.
    Under interleaved-1f1b and zero-bubble (`ranks` P, `split` the P × V stages' layers) the groups are of ranks,
    each alone: rank r warms up min((V - 1) × M / rounds + f × (P - 1 - r), M × V) forwards (`_get_warmup_ops`;
    f = 2 under interleaved-1f1b, 1 under zero-bubble), a count of its own, and holds its own stages. `ranks` is
    only read then (GPipe and 1F1B group `split`'s stages)."""
    if schedule.multi_stage:
        return [(r,) for r in range(ranks)]
    if schedule is PipelineSchedule.GPIPE:
        return stage_classes(split)
    groups: dict[tuple, list[int]] = {}
    for g in stage_classes(split):
        for k in g:
            groups.setdefault((g[0], min(micro_batches, len(split) - k)), []).append(k)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


class StageModule(torch.nn.Module):
    """A contiguous piece of an HF decoder LM: [embeddings] + layers[lo:hi] + [final norm + lm_head].
    LlamaForCausalLM and its kin: `embed_tokens`, the layers called with (cos, sin) from the stage's own copy of
    `rotary_emb` (LlamaModel.forward computes them once per forward), `norm`. GPT2LMHeadModel: `wte` + `wpe`
    (positions arange(S)) then the embedding dropout (GPT2Model.forward), the blocks `h` called as block(h, None,
    None) (no cache, no mask), `ln_f`. `forward(x)`: token ids (B, S) int64 on the first stage, else hidden states
    (B, S, hidden); returns hidden states, or the logits (B, S, vocab) on the last stage. Its body runs under
    `self.autocast()` (a mixed precision: autocast around each stage's forward, once per micro-batch, the
    schedule's loss outside it; so each micro-batch's forward makes its own low-precision weight copies, saved for
    its backward)."""

    def __init__(self, model: torch.nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.autocast = contextlib.nullcontext
        self.gpt2 = hasattr(model, "transformer")
        base = model.transformer if self.gpt2 else model.model
        self.embed_tokens = (base.wte if self.gpt2 else base.embed_tokens) if first else None
        self.embed_positions = base.wpe if first and self.gpt2 else None
        self.drop = base.drop if first and self.gpt2 else None
        self.layers = torch.nn.ModuleList((base.h if self.gpt2 else base.layers)[lo:hi])
        self.rotary_emb = None if self.gpt2 else base.rotary_emb
        self.norm = (base.ln_f if self.gpt2 else base.norm) if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            if self.gpt2:
                if self.embed_positions is not None:
                    h = self.drop(h + self.embed_positions(pos))
                for layer in self.layers:
                    h = layer(h, None, None)
            else:
                pe = self.rotary_emb(h, position_ids=pos)
                for layer in self.layers:
                    h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            if self.lm_head is not None:
                h = self.lm_head(self.norm(h))
            return h


class RankModule(torch.nn.Module):
    """The stages one rank holds under interleaved-1f1b and zero-bubble (`stages`: a StageModule each, in the order
    of `rank_stages`, `indices` their global stage indices), one module so that the rank's one optimizer takes all
    their parameters, in that order (what tests/pp_oracle.py's user does: one AdamW over `[p for sub in subs for p
    in sub.parameters()]`). Each stage is registered as `stage<k>` by its global index k, so a tensor's module path
    names its stage (`stage3.lm_head.weight` on rank 1 of 2) and no two stages fold into one row of the report
    (analysis/aggregate.py folds numeric indices). Not called: the schedule calls each stage's module."""

    def __init__(self, stages: list[StageModule], indices: tuple[int, ...]):
        super().__init__()
        self.indices = tuple(indices)
        for k, sub in zip(self.indices, stages, strict=True):
            self.add_module(f"stage{k}", sub)

    @property
    def stages(self) -> tuple[StageModule, ...]:
        """The rank's stages, in the order of `indices`."""
        return tuple(getattr(self, f"stage{k}") for k in self.indices)

    @property
    def _vramtrace_forward_roots(self) -> tuple[StageModule, ...]:
        """The modules whose forward is the rank's forward (tracer/hooks.py `module_hooks`: ops inside them are
        the forward phase, what they save for backward activations): its stages."""
        return self.stages

    @property
    def layer_stack(self) -> torch.nn.ModuleList:
        """Every decoder layer of the rank's stages, in stage order (not registered twice: a fresh list)."""
        return torch.nn.ModuleList([layer for sub in self.stages for layer in sub.layers])


_LAYOUTS = (("model", ("embed_tokens", "layers", "rotary_emb", "norm")),
            ("transformer", ("wte", "wpe", "drop", "h", "ln_f")))


# the config model types `StageModule` cuts right: its layers run with no attention mask (causal SDPA), so a
# model whose layers need their mask (mistral's or qwen2's sliding window, gemma's) is refused, not mis-modelled
PIPELINE_MODEL_TYPES = ("llama", "gpt2")


def check_model(model: torch.nn.Module) -> None:
    """Raise UsageError unless `model`'s `config.model_type` is one of PIPELINE_MODEL_TYPES and it is laid out as
    the decoder LMs `StageModule` cuts: LlamaForCausalLM (`model.embed_tokens`, `model.layers`, `model.rotary_emb`,
    `model.norm`, `lm_head`) or GPT2LMHeadModel (`transformer.wte`, `wpe`, `drop`, `h`, `ln_f`, `lm_head`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PIPELINE_MODEL_TYPES:
        raise UsageError(f"--pp cuts {' and '.join(PIPELINE_MODEL_TYPES)} decoder LMs; model_type {model_type} is "
                         "not modelled yet (its layers may need their attention mask, which a stage does not pass)")
    if hasattr(model, "lm_head") and any(
            hasattr(model, base) and all(hasattr(getattr(model, base), p) for p in parts)
            for base, parts in _LAYOUTS):
        return
    raise UsageError(f"--pp cuts decoder LMs laid out as LlamaForCausalLM (model.embed_tokens, model.layers, "
                     f"model.rotary_emb, model.norm, lm_head) or GPT2LMHeadModel; {type(model).__name__} is not "
                     "modelled yet")


def cut(model: torch.nn.Module, split: tuple[int, ...], k: int, keep: int | None = None) -> StageModule:
    """Stage `k` of `model` under `split`, deep-copied (its own parameters: a tied head gets its own copy); with
    `keep`, only the stage's first `keep` layers (a copy to trace and replicate, `stage_plan`)."""
    return copy.deepcopy(_stage_module(model, split, k, keep))


def _stage_module(model: torch.nn.Module, split: tuple[int, ...], k: int, keep: int | None = None) -> StageModule:
    """Stage `k` of `model` under `split`, its modules `model`'s own (not copied)."""
    bounds = list(itertools.accumulate(split, initial=0))
    hi = bounds[k + 1] if keep is None else min(bounds[k + 1], bounds[k] + keep)
    return StageModule(model, bounds[k], hi, k == 0, k == len(split) - 1)


def stage_plan(spec: RunSpec, loaded):
    """(LayerPlan of stage `spec.stage`'s layers, note): the stage traced with `TRACED_LAYERS` of its layers and
    the rest rebuilt (tracer/replication.py) when it has more and replication is on; else (None, why every layer
    of the stage is traced). Under interleaved-1f1b a rank holds several stages, each its own layer stack, which
    the replication's one stack does not describe: every layer is traced."""
    from .replication import TRACED_LAYERS, LayerPlan

    if spec.pp_schedule.multi_stage:
        return None, f"traced every layer of the rank's stages ({spec.pp_schedule.value}: a layer stack per stage)"
    n = stage_split(spec, loaded.num_layers)[spec.stage or 0]
    if not spec.replicate_layers or n <= TRACED_LAYERS:
        return None, "traced every layer of the stage"
    # each micro-batch's forward and backward is one sweep over the stage's layers, whatever order the schedule
    # runs them in (GPipe all forwards first; 1F1B one backward between two forwards)
    return LayerPlan("layers", n), ""


def cut_rank(spec: RunSpec, model: torch.nn.Module, split: tuple[int, ...], keep: int | None = None
             ) -> StageModule | RankModule:
    """What rank `spec.stage` (0 when None) holds: its stage (`cut`), or under interleaved-1f1b a RankModule of
    its `rank_stages`, deep-copied together: the modules its stages share stay one (a Llama's `rotary_emb`, whose
    `inv_freq` buffers the rank then holds once, as a user who cuts the rank's stages from one model does:
    tests/pp_oracle.py `_build`)."""
    k = spec.stage or 0
    if spec.pp_virtual_stages == 1:
        return cut(model, split, k, keep)
    held = rank_stages(k, spec.pp, spec.pp_virtual_stages)
    return copy.deepcopy(RankModule([_stage_module(model, split, s) for s in held], held))


def stage_parameter_bytes(spec: RunSpec, model: torch.nn.Module) -> dict[str, int]:
    """Bytes of each parameter of stage `spec.stage` (0 when None; the rank under interleaved-1f1b) of `model`,
    by its name in the stage module (`cut_rank`)."""
    split = stage_split(spec, len(model.transformer.h if hasattr(model, "transformer") else model.model.layers))
    return {n: p.untyped_storage().nbytes() for n, p in cut_rank(spec, model, split).named_parameters()}


def stage_outputs(model: torch.nn.Module, split: tuple[int, ...], micro: torch.Tensor, policy) -> list[torch.Tensor]:
    """What each stage outputs for one micro-batch of token ids `micro` (mb, S): the stages run in order on meta
    under `policy` (a `KernelPolicyMode`, its autocast on for a mixed precision) with grad enabled, so that each
    output's dtype (an autocast output) and `requires_grad` are the real ones (a static `PipelineStage` whose input
    meta did not require grad would run no input-gradient backward and send zeros: stage.py
    `_retrieve_recv_activations`). Each a fresh meta leaf of the output's shape, dtype and requires_grad."""
    bounds = list(itertools.accumulate(split, initial=0))
    last = len(split) - 1
    outs, h = [], micro
    with torch.enable_grad(), policy:
        for k in range(len(split)):
            sub = StageModule(model, bounds[k], bounds[k + 1], k == 0, k == last)
            if policy.autocast_dtype is not None:
                sub.autocast = policy.autocast_region
            h = sub(h)
            outs.append(torch.empty_like(h, device="meta").requires_grad_(h.requires_grad))
            h = h.detach().requires_grad_(h.requires_grad)
    return outs


# model -> {(split, micro-batch shape and dtype, policy, parameters' dtypes and requires_grad): `stage_outputs`}: a
# pipeline's stages are traced one after another on the same model (pp_stages.py `trace_stages`: 8 under 1F1B with
# 8 ranks), and each trace would otherwise run the whole model's forward again for the same outputs
_STAGE_OUTPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_stage_outputs(model: torch.nn.Module, split: tuple[int, ...], micro: torch.Tensor, device, sm: int,
                          compute_dtype: torch.dtype | None) -> list[torch.Tensor]:
    """`stage_outputs` under `KernelPolicyMode(device, sm, compute_dtype)`, made once per model and key. The outputs
    are fresh meta leaves that a stage only reads for their metadata (the static `PipelineStage`'s input, output
    and output-gradient metadata, `_static_stage`)."""
    from .kernels import KernelPolicyMode

    key = (tuple(split), tuple(micro.shape), micro.dtype, device, sm, compute_dtype,
           tuple((p.dtype, p.requires_grad) for p in model.parameters()))
    made = _STAGE_OUTPUTS.setdefault(model, {})
    if key not in made:
        made[key] = stage_outputs(model, split, micro, KernelPolicyMode(device, sm, compute_dtype))
    return made[key]


@dataclass(slots=True)
class StageTrace:
    """What one traced stage's step leaves for the report: the micro-step running at each op (`labels`: (first
    op index, label, micro-batches in flight) in op order, from `PIPELINE_MICRO_STEPS`). The receive buffers and
    held sends are categorised in the records (`Category.PIPELINE_BUFFERS`, named `RECV_BUFFER...`/`HELD_SEND`)."""

    labels: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)

    def remap(self, new_index: list[int], end: int) -> None:
        """The labels' op indices after layer replication (`new_index`: traced op index -> rebuilt; `end`: the
        rebuilt op count, for a label placed after the last op)."""
        self.labels = [(new_index[i] if i < len(new_index) else end, label, flight)
                       for i, label, flight in self.labels]

    def at(self, op: int) -> tuple[str, tuple[int, ...]]:
        """(label, in flight) of the micro-step running at op index `op` ('loop', () outside every micro-step)."""
        found = ("loop", ())
        for start, label, flight in self.labels:
            if start > op:
                break
            found = (label, flight)
        return found


def schedule_class(schedule: PipelineSchedule):
    """The torch schedule class of `schedule`. Raises UsageError for a schedule not modelled yet."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    classes = {PipelineSchedule.GPIPE: ScheduleGPipe, PipelineSchedule.ONE_F_ONE_B: Schedule1F1B,
               PipelineSchedule.INTERLEAVED_1F1B: ScheduleInterleaved1F1B,
               PipelineSchedule.ZERO_BUBBLE: ScheduleInterleavedZeroBubble}
    if schedule not in classes:
        raise UsageError(f"--pp-schedule {schedule.value} is not modelled yet; use one of "
                         f"{', '.join(s.value for s in classes)}")
    return classes[schedule]


def _static_stage(sub: StageModule, k: int, micro: torch.Tensor, outs: list[torch.Tensor]):
    """PipelineStage `k` of len(`outs`) stages in static metadata mode: `micro` one micro-batch of the stage-0
    input, `outs` each stage's output meta (`stage_outputs`)."""
    from torch.distributed.pipelining import PipelineStage

    first, last = k == 0, k == len(outs) - 1
    received = None if first else outs[k - 1]
    return PipelineStage(sub, k, len(outs), torch.device("meta"), input_args=micro if first else received,
                         output_args=outs[k], output_grads=None if last else outs[k],
                         input_grads=None if first else received)


def build_stage(spec: RunSpec, sub: StageModule | RankModule, k: int, micro: torch.Tensor,
                outs: list[torch.Tensor], loss_fn: Callable):
    """(the rank's PipelineStages, schedule) of rank `k` (`_static_stage`: stage k, or under interleaved-1f1b
    each of the RankModule's stages, `rank_stages`); the schedule with M = `spec.micro_batches` (None: P), given
    the one stage, or the list of them (ScheduleInterleaved1F1B)."""
    if not isinstance(sub, RankModule):
        stage = _static_stage(sub, k, micro, outs)
        return [stage], schedule_class(spec.pp_schedule)(stage, n_microbatches=spec.pp_micro_batches,
                                                         loss_fn=loss_fn)
    stages = [_static_stage(m, s, micro, outs)
              for m, s in zip(sub.stages, rank_stages(k, spec.pp, spec.pp_virtual_stages))]
    return stages, schedule_class(spec.pp_schedule)(stages, n_microbatches=spec.pp_micro_batches, loss_fn=loss_fn)


RECV_BUFFER = "receive buffer"  # the name prefix of a stage's receive buffers (`StageTrace`)
HELD_SEND = "sent, held by its Work"  # the name of an input gradient a send Work holds


def _name_buffers(stage, rec, where: str = "") -> None:
    """Categorise the stage's receive buffers (made in its first step and kept for its life: stage.py
    `PipelineStage._setup_forward_recv_info`, `_create_grad_recv_info`, one per micro-batch in `_RecvInfo.buffer`)
    as pipeline buffers, named by direction and micro-batch. The attributes are bridges.py PIPELINE_STAGE_STATE's
    and PIPELINE_RECV_BUFFER's, checked when the step's patches are entered: no default hides a rename. `where`
    ends each name (the stage, under interleaved-1f1b)."""
    for kind, infos in (("activation", stage.args_recv_info), ("gradient", stage.grad_recv_info)):
        for chunk, recvs in infos.items():
            for info in recvs:
                if info.buffer is not None:
                    rec.set_category(info.buffer, Category.PIPELINE_BUFFERS,
                                     f"{RECV_BUFFER} ({kind}, micro-batch {chunk}{where})")


def pipeline_step(spec: RunSpec, sched, stages, ids: torch.Tensor | None, labels: torch.Tensor | None, ctx, rec,
                  info: StageTrace) -> Callable:
    """The step function of one rank (`trace._record_on`'s `step_of`), as a user's loop writes it (a mixed
    precision's autocast inside each stage forward, `StageModule`):

        out = schedule.step(ids)                        # stage 0
        out = schedule.step(target=labels, losses=[])   # the last stage
        out = schedule.step()                           # a middle stage
        del out; optimizer.step(); optimizer.zero_grad()   # no optimizer on a stage without parameters

    under the bridges of `feature_bridges.pipelining_on_meta`, which report each micro-step to `info` with the op
    index it starts at (`rec.ops`) and the micro-batches then in flight, and a saved-tensor hook of its own
    (`pack`); `optimizer.step()` is labelled 'opt' (tests/pp_oracle.py's `record_function("opt")`), what follows
    it 'loop'. `stages`: the rank's PipelineStages (several under interleaved-1f1b and zero-bubble, whose
    micro-steps are labelled 'F<i>@<stage>')."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .. import feature_bridges

    def on_micro_step(label: str, in_flight: tuple[int, ...]) -> None:
        info.labels.append((len(rec.ops), label, in_flight))

    def on_send(tensors) -> None:
        for t in tensors:
            rec.set_category(t, Category.PIPELINE_BUFFERS, HELD_SEND)

    several = tuple(stages) if len(stages) > 1 else ()

    def pack(t: torch.Tensor) -> torch.Tensor:
        # the recorder's saved-tensor hook (it marks activations), keeping an alias without the autograd graph:
        # returned as is, an output its own node saves (log_softmax's) would hold that node, a cycle through C++
        # that Python's gc cannot break. A backward frees saved tensors as it runs, so it does not matter there;
        # zero-bubble's input-gradient backward keeps the graph for the weight pass, and the graph's saved tensors
        # then outlived the step (rank 1 of a tiny Llama +52%); autograd itself saves an output without its
        # grad_fn (torch/csrc/autograd/saved_variable.cpp), what the alias does
        rec.pack_hook(t)
        if t.grad_fn is None:
            return t
        with _disable_current_modes():  # the alias is no op of the step (bridges.py DISPATCH_TOOLKIT)
            return t.detach()

    def step(model, batch, optimizer) -> None:
        for stage in stages:
            stage.submod.autocast = ctx.autocast
        with feature_bridges.pipelining_on_meta(on_micro_step, on_send, several), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if ids is not None:
                out = sched.step(ids)
            elif labels is not None:
                out = sched.step(target=labels, losses=[])
            else:
                out = sched.step()
        del out
        for stage in stages:
            _name_buffers(stage, rec, f", stage {stage.stage_index}" if several else "")
        if optimizer is not None:
            on_micro_step("opt", ())  # the oracle's record_function("opt") around optimizer.step()
            optimizer.step()
            on_micro_step("loop", ())
            optimizer.zero_grad(set_to_none=spec.zero_grad is ZeroGrad.NONE)
    return step


def record_stage(spec: RunSpec, loaded, record_on: Callable, traced_layers: int | None = None):
    """Trace stage `spec.stage` (0 when None) of `spec.pp` of `loaded.model` (under interleaved-1f1b rank
    `spec.stage` with its `rank_stages`, a RankModule): `record_on(spec, stage module, the
    stage's LoadedModel, its layers, step_of=...)` (trace.py `_record_on`) inside `sharding.fake_rank(P, k)`; with
    `traced_layers`, the stage keeps only its first that many layers (`stage_plan`: the rest rebuilt by layer
    replication). Returns what `record_on` returns; the recorder's `pipeline` holds the stage's `StageTrace`.
    Raises UsageError (a model not cut this way, a bad split, a schedule not modelled)."""
    model = loaded.model
    from .sharding import fake_rank

    check_model(model)
    split = stage_split(spec, loaded.num_layers)
    k, P = spec.stage or 0, spec.pp
    held = rank_stages(k, P, spec.pp_virtual_stages)
    first, last = 0 in held, len(split) - 1 in held
    ids = loaded.inputs["input_ids"]
    labels = loaded.inputs.get("labels", ids)
    micro = torch.empty((spec.batch // spec.pp_micro_batches, *ids.shape[1:]), dtype=ids.dtype, device="meta")
    outs = _shared_stage_outputs(model, split, micro, spec.device, spec.gpu_preset.sm, loaded.compute_dtype)
    vocab = model.config.get_text_config().vocab_size
    loss_fn = functools.partial(model.loss_function, vocab_size=vocab)
    with fake_rank(P, k):
        sub = cut_rank(spec, model, split, traced_layers)
        stages, sched = build_stage(spec, sub, k, micro, outs, loss_fn)
        inputs = {"input_ids": ids} if first else {"labels": labels} if last else {}
        stage_loaded = replace(loaded, model=sub, inputs=inputs, args=(), held={}, layer_plan=None,
                               traced_model=None)
        info = StageTrace()

        def step_of(ctx, rec):
            rec.pipeline = info
            return pipeline_step(spec, sched, stages, ids if first else None, labels if last else None, ctx, rec,
                                 info)
        layers = sub.layer_stack if isinstance(sub, RankModule) else sub.layers
        return record_on(spec, sub, stage_loaded, layers, step_of=step_of)
