"""The checks of a RunSpec's pipeline-parallel options (`--pp`, tracer/pipelining.py), torch-free.

`check_pipeline(spec, bad)` parses `pp_schedule` and `pp_split` into the spec and raises `bad(template)` (spec.py
`_bad`: a SpecError naming RunSpec's fields as `{field}`, which the CLI words as its options) for options that do
not go together. What is traced: a training step of a transformers decoder LM cut into `pp` stages, one rank's
`schedule.step` with `micro_batches` micro-batches of `batch // micro_batches` rows (`batch` is the batch of one
pipeline step, as `schedule.step(x)` splits it: torch/distributed/pipelining/microbatch.py `split_args_kwargs_into_
chunks`, `torch.tensor_split` on dim 0, which gives equal micro-batches only when M divides the batch).
"""

from __future__ import annotations

import itertools
from typing import Callable

from .choices import Loop, Mode, PipelineSchedule, Precision

TRACED_SCHEDULES = (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.INTERLEAVED_1F1B,
                    PipelineSchedule.ZERO_BUBBLE)


def parse_split(value, pp: int | None, bad: Callable, virtual: int = 1) -> tuple[int, ...] | None:
    """`pp_split` as a tuple of non-negative ints: from a tuple/list of ints or a string 'a,b,...'. Raises
    bad(...) for a malformed split or one of the wrong length (pp × `virtual` stages)."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        split = tuple(int(str(p).strip()) for p in parts)
    except ValueError:
        split = ()
    if not split or any(n < 0 for n in split) or any(isinstance(p, (bool, float)) for p in parts):
        raise bad(f"bad {{pp_split}} {value!r}; give the decoder layers of each stage, e.g. 3,3,2 (0 allowed)")
    if pp is not None and len(split) != pp * virtual:
        stages = f"{{pp}} {pp} × {{virtual_stages}} {virtual} make {pp * virtual}" if virtual > 1 \
            else f"{{pp}} is {pp}"
        raise bad(f"{{pp_split}} {','.join(map(str, split))} names {len(split)} stages; {stages}: give one "
                  "layer count per stage")
    return split


def interleaved_accepts(m: int, pp: int) -> bool:
    """Whether torch's interleaved schedules take `m` micro-batches over `pp` ranks: M a multiple of its
    max(1, M // P) rounds (schedules.py `ScheduleInterleaved1F1B.__init__`), true of every multiple of P and of
    every M < 2P."""
    return m % max(1, m // pp) == 0


def _positive(spec, name: str, bad: Callable, least: int = 1) -> None:
    v = getattr(spec, name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
        raise bad(f"{{{name}}} must be an integer of at least {least}, got {v!r}")


def check_pipeline(spec, bad: Callable) -> None:
    """Parse `spec.pp_schedule` and `spec.pp_split` (object.__setattr__ on the frozen spec) and raise
    bad(template) for pipeline options that are malformed, do not go together, or are not modelled yet."""
    object.__setattr__(spec, "pp_schedule", PipelineSchedule.parse(spec.pp_schedule, "{pp_schedule}"))
    _positive(spec, "pp", bad, 2)
    _positive(spec, "micro_batches", bad)
    one_virtual = spec.virtual_stages == 1 and not isinstance(spec.virtual_stages, bool)
    if not one_virtual:
        _positive(spec, "virtual_stages", bad, 2)
    interleaved = spec.pp_schedule.multi_stage
    if spec.virtual_stages is not None and spec.pp is not None and not interleaved:
        raise bad(f"{{virtual_stages}} applies to {{pp_schedule}} interleaved-1f1b and zero-bubble (several stages "
                  "per rank); "
                  f"{spec.pp_schedule.value} runs one stage per rank: drop {{virtual_stages}}")
    if one_virtual and spec.pp is not None:
        # torch's interleaved schedules with one stage per rank are not Schedule1F1B (pipeline_order, fake group,
        # P = 4, M = 8): schedules.py `_get_warmup_ops` has rank r run 2 (P - 1 - r) + 1 forwards before its first
        # backward (1F1B: P - r), and `ScheduleInterleavedZeroBubble` splits each backward in two (I and W steps)
        why = ("rank r runs 2(P-1-r)+1 forwards before its first backward, 1f1b P-r"
               if spec.pp_schedule is PipelineSchedule.INTERLEAVED_1F1B
               else "it splits each backward into input- and weight-gradient steps")
        raise bad(f"{{virtual_stages}} 1 under {{pp_schedule}} {spec.pp_schedule.value} is not modelled (torch's "
                  f"schedule with one stage per rank is not 1f1b: {why}); give {{virtual_stages}} 2 or more")
    object.__setattr__(spec, "pp_split", parse_split(spec.pp_split, spec.pp, bad, spec.pp_virtual_stages or 1))
    if spec.pp is None:
        given = [f for f, v in (("{micro_batches}", spec.micro_batches), ("{virtual_stages}", spec.virtual_stages),
                                ("{pp_split}", spec.pp_split), ("{stage}", spec.stage),
                                ("{pp_schedule}", spec.pp_schedule is not PipelineSchedule.ONE_F_ONE_B or None))
                 if v is not None]
        if given:
            raise bad(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to {{pp}} P (pipeline "
                      "parallelism); add it or drop them")
        return
    if spec.pp_schedule not in TRACED_SCHEDULES:
        raise bad(f"{{pp_schedule}} {spec.pp_schedule.value} is not modelled yet; use one of "
                  f"{', '.join(s.value for s in TRACED_SCHEDULES)}")
    if spec.stage is not None and (isinstance(spec.stage, bool) or not isinstance(spec.stage, int)
                                   or not 0 <= spec.stage < spec.pp):
        what = f"ranks ({{stage}} K is rank K under {spec.pp_schedule.value})" if interleaved else "stages"
        raise bad(f"{{stage}} must be in 0..{spec.pp - 1} for {spec.pp} {what}, got {spec.stage!r}")
    m = spec.pp_micro_batches
    if spec.pp_schedule is PipelineSchedule.ONE_F_ONE_B and m < spec.pp:
        # torch/distributed/pipelining/schedules.py `Schedule1F1B.__init__` raises the same
        raise bad(f"{{pp_schedule}} 1f1b needs at least as many micro-batches as stages: {{micro_batches}} {m} < "
                  f"{{pp}} {spec.pp}")
    if interleaved and not interleaved_accepts(m, spec.pp):
        # torch/distributed/pipelining/schedules.py `ScheduleInterleaved1F1B.__init__` and
        # `ScheduleInterleavedZeroBubble.__init__` raise the same: they run max(1, M // P) rounds of equal size
        below = next(n for n in range(m - 1, 0, -1) if interleaved_accepts(n, spec.pp))
        above = next(n for n in itertools.count(m + 1) if interleaved_accepts(n, spec.pp))
        raise bad(f"{{pp_schedule}} {spec.pp_schedule.value} runs max(1, M // P) = {m // spec.pp} rounds of equal "
                  f"size: {{micro_batches}} {m} is not a multiple of {m // spec.pp}; use a multiple of {{pp}} "
                  f"{spec.pp} or fewer than {2 * spec.pp} (the nearest accepted: {below} or {above})")
    if spec.batch % m:
        raise bad(f"{{batch}} {spec.batch} does not split into {m} equal micro-batches ({{micro_batches}}"
                  f"{'' if spec.micro_batches else ' defaults to {pp}'}); make {{batch}} a multiple of {m}")
    _check_pipeline_composition(spec, bad)


def _check_pipeline_composition(spec, bad: Callable) -> None:
    """Raise bad(...) for what a --pp run does not trace yet (one line naming the option to drop)."""
    from .custom_inputs import custom_ref

    if Mode.parse(spec.mode, "mode") is not Mode.TRAIN:
        raise bad(f"{{pp}} traces a training step; {{mode}} {Mode.parse(spec.mode, 'mode').value} is not "
                  "supported with it yet")
    if custom_ref(spec.model) is not None or not isinstance(spec.model, str):
        raise bad("{pp} cuts a transformers decoder LM into stages; a custom module has no such layout: drop {pp}")
    for flag, value in (("{fsdp}", spec.fsdp), ("{tp}", spec.tp), ("{ddp}", spec.ddp), ("{zero}", spec.zero),
                        ("{rank}", spec.rank),
                        ("{quantization}", spec.quantization), ("{lora_rank}", spec.lora_rank),
                        ("{recipe}", spec.recipe), ("{step}", spec.step),
                        ("{clip_grad_norm}", spec.clip_grad_norm), ("{serve_requests}", spec.serve_requests)):
        if value is not None:
            raise bad(f"{{pp}} with {flag} is not supported yet; drop one of the two"
                      + (" ({stage} K picks a stage)" if flag == "{rank}" else ""))
    if spec.loop is not Loop.TRAINER:
        raise bad(f"{{pp}} runs the schedule's own loop (schedule.step, then the optimizer); {{loop}} "
                  f"{spec.loop.value} does not apply to it: drop {{loop}}")
    if spec.compile or spec.packing or spec.grad_accum != 1:
        raise bad("{pp} with {compile}, {packing} or {grad_accum} is not supported yet (the schedule's "
                  "micro-batches are its gradient accumulation); drop them")
    if spec.precision is not None and Precision.parse(spec.precision, "precision") in (Precision.FP16_MIXED,
                                                                                        Precision.FP16_AUTOCAST):
        raise bad("{pp} with {precision} fp16 (a GradScaler around the schedule) is not modelled yet; use "
                  "bf16-mixed or fp32")
