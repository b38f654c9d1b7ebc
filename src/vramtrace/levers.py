"""What makes it fit: the levers a user can pull when a step does not fit, each traced exactly with the lever applied.

A lever is a change of the run that a user makes with one option (the option is its name): `--use-cache false`,
another `--optimizer-impl`, a `--checkpointing` policy, a smaller `--batch` with `--grad-accum` keeping the
effective batch, `--lora-rank`. Every lever is traced and analysed like the main run (its peak is a prediction of
the same kind, never an estimate) and marked fits or not on the verdict's basis (`search.compared_bytes`: peak
reserved on a CUDA target, peak allocated on the CPU).

Levers are ranked from cheapest, by what they cost the run, then by how much they save:
  0. free: the same training at the same speed (`--use-cache false`: training never reads the cache; the fused
     optimizer: the same update in fewer kernels);
  1. a slower optimizer step (the for-loop implementation: one kernel per tensor and op), or bitsandbytes' 8-bit
     AdamW states (the same update from blockwise-quantized moments);
  2. recompute: checkpointing, ranked by its recompute FLOPs as a share of the step's forward + backward FLOPs;
  3. throughput: k micro-batches per optimizer step instead of one (the same effective batch and update, lower
     GPU utilisation at small micro-batches), ranked by k;
  4. a different training: LoRA trains adapters on the frozen base weights; QLoRA keeps those base weights in 4-bit
     NF4 (bitsandbytes);
  5. more hardware: FSDP2 over the fewest GPUs that fits (`--fsdp N`), ranked by N; for a --zero run a higher
     ZeRO stage on its GPUs; for a --pp run a deeper pipeline (`--pp P'`).

Under --pp every lever is traced on the whole pipeline (every distinct stage; its figure the largest stage's, so
it fits exactly when every stage does), or on stage K alone with --stage K; the families are `PP_FAMILIES`, the
micro-batch lever there meaning more micro-batches per pipeline step (`--micro-batches`). A whole pipeline's stages
are traced in the order most likely to fail first (`stage_order`) and the tracing stops at the first stage that
alone does not fit the budget (`pipeline_outcome`): that lever's figures are that stage's, a lower bound of the
pipeline's largest stage, and its row says so (`LeverRow.decided_by_stage`).

When no single lever fits, a combination is built: each family's strongest lever is added in rank order until
the run fits; then the non-free levers the fit does not need are dropped (most expensive first), and
checkpointing and the micro-batch are relaxed to the cheapest setting that still fits. Every step of that is
traced.

The families are `FAMILIES`, in rank order. A lever whose trace needs an optional extra that is not installed
(peft for LoRA, bitsandbytes for the 8-bit optimizer and QLoRA) is not traced: the report lists it under
`skipped` with the extra that adds it. A family whose trace fails for any other reason is listed there too, as
"could not be traced" with the error's first line; the other levers and the report are kept (the traceback goes to
the `vramtrace.levers` logger at DEBUG level, which the CLI shows with --debug).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

from .planner import search_checkpointing
from .report.sections import LeverCombination, LeverRow, LeversSummary, SkippedLever, SkipReason
from .search import MAX_RANKS, TraceSession, basis_text, compared_bytes, fewest_ranks, fits_budget
from .errors import UsageError
from .custom_inputs import custom_ref
from .spec import (BNB_OPTIMIZERS, OPTIMIZER_IMPLS, CheckpointingKind, Device, Mode, OptimizerImpl, OptimizerKind,
                   RunSpec)
from .tables import Outcome

LORA_RANK = 16  # the LoRA lever's rank: peft's examples and HF's PEFT guides start at r=8..16
# what a skipped family's row calls it
FAMILY_TITLES = {"use_cache": "no KV cache", "optimizer_impl": "another optimizer implementation",
                 "optimizer_8bit": "8-bit optimizer", "checkpointing": "checkpointing", "micro_batch": "micro-batches",
                 "lora": f"LoRA r={LORA_RANK}", "qlora": "QLoRA", "fsdp": "FSDP2", "zero": "ZeRO stage",
                 "combination": "the combination", "pp": "a deeper pipeline",
                 "not_under_pp": "LoRA, QLoRA and FSDP2"}


class Extra(str, Enum):
    """vramtrace's optional extras (pyproject.toml's [project.optional-dependencies]) that levers need, by the
    package a trace imports: peft (`tracer/adapters.py`), bitsandbytes (`tracer/quantization.py`, the 8-bit
    optimizers). The `quant` extra installs peft too."""

    LORA = "peft"
    QUANT = "bitsandbytes"

    @property
    def option(self) -> str:
        return {"peft": "lora", "bitsandbytes": "quant"}[self.value]


def missing_extras(spec: RunSpec) -> tuple[Extra, ...]:
    """The extras `spec`'s trace needs that are not installed (`importlib.util.find_spec` finds no package):
    peft for `lora_rank`, bitsandbytes for `quantization` and the bitsandbytes optimizers (`spec.BNB_OPTIMIZERS`)."""
    import importlib.util

    needed = []
    if spec.quantization is not None or spec.optimizer in BNB_OPTIMIZERS:
        needed.append(Extra.QUANT)
    if spec.lora_rank is not None:
        needed.append(Extra.LORA)
    return tuple(e for e in needed if importlib.util.find_spec(e.value) is None)


def needs_text(extras: tuple[Extra, ...]) -> str:
    """"needs peft (pip install 'vramtrace[lora]')"; one install line covers them all (`quant` includes peft)."""
    option = Extra.QUANT.option if Extra.QUANT in extras else Extra.LORA.option
    return f"needs {' and '.join(e.value for e in extras)} (pip install 'vramtrace[{option}]')"


class NotTraced(Exception):
    """A lever's trace that was not made (`reason`) or failed: `options` the command-line options that differ
    from the run, `detail` one line for the user."""

    def __init__(self, reason: SkipReason, options: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.options, self.detail = reason, options, detail

    def row(self, family: str) -> SkippedLever:
        """The report's `levers.skipped` row for the lever family `family`."""
        return SkippedLever(family=family, title=FAMILY_TITLES.get(family, family), options=self.options,
                            reason=self.reason, detail=self.detail)


@dataclass(frozen=True, slots=True)
class Lever:
    """One lever, traced. `changes`: the RunSpec fields it sets, as (name, value) pairs; `rank`: (cost class
    0..5, amount) as in the module docstring; `cost`: what it costs, in words."""

    family: str
    changes: tuple[tuple[str, object], ...]
    rank: tuple[int, float]
    cost: str
    outcome: Outcome
    fits: bool
    decided_by_stage: int | None = None  # a whole pipeline's stage that alone does not fit (`pipeline_outcome`)

    @property
    def options(self) -> str:
        """The command-line options that apply it, e.g. '--checkpointing selective'."""
        return options_text(dict(self.changes))

    def row(self, base_bytes: int) -> LeverRow:
        """The report's `levers.levers` row, with the compared bytes it saves against `base_bytes` (an upper bound
        of what the pipeline saves when one stage decided it: `decided_by_stage`)."""
        o = self.outcome
        return LeverRow(family=self.family, options=self.options, cost=self.cost,
                        peak_allocated_bytes=o.peak_allocated_bytes, peak_reserved_bytes=o.peak_reserved_bytes,
                        compared_bytes=compared_bytes(o), saves_bytes=base_bytes - compared_bytes(o), fits=self.fits,
                        recompute_overhead=o.recompute_overhead, decided_by_stage=self.decided_by_stage)


# RunSpec fields whose option is `--name value` (the value as the CLI takes it)
_VALUE_OPTIONS = ("checkpointing", "lora_rank", "fsdp", "quantization", "bnb_compute_dtype", "zero", "pp",
                  "micro_batches", "stage")


def options_text(changes: dict) -> str:
    """'--use-cache false --checkpointing layers' for a dict of RunSpec field changes."""
    parts = []
    for name, value in changes.items():
        if name in _VALUE_OPTIONS:
            parts.append(f"--{name.replace('_', '-')} {value.value if isinstance(value, Enum) else value}")
        elif name == "use_cache":
            parts.append(f"--use-cache {str(value).lower()}")
        elif name == "grad_accum":
            continue  # printed with the batch
        elif name == "batch":
            parts.append(f"--batch {value} --grad-accum {changes['grad_accum']}")
        elif name == "optimizer_impl":  # the default implementation goes without saying with another optimizer
            if not (value is OptimizerImpl.DEFAULT and "optimizer" in changes):
                parts.append(f"--optimizer-impl {value.value}")
        elif name == "optimizer":
            parts.append(f"--optimizer {OptimizerKind.parse(value).value}")
        elif name == "double_quant":
            parts.append("--double-quant" if value else "")
        else:  # pragma: no cover - a family added without its option text
            raise ValueError(f"no option text for {name}")
    return " ".join(p for p in parts if p)


LEVER_CACHE_ENV = "VRAMTRACE_LEVER_CACHE"  # a directory, or "off"; default $XDG_CACHE_HOME/vramtrace/levers
# RunSpec fields that change only the verdict, never a trace's `Outcome` (`tables.outcome` replays the allocator
# without a capacity): left out of the cache's key, so that a run on another capacity finds the same traces
_VERDICT_FIELDS = frozenset({"gpu_memory_bytes", "cuda_context_bytes", "memory_budget_bytes"})


class LeverDiskCache:
    """The outcomes of lever traces on disk, for the next run of the same command (a user who reads the levers,
    then tries one, runs the same search again): one JSON file per traced spec, named by a digest of everything
    that changes the trace: the RunSpec (every field but those of the verdict, `_VERDICT_FIELDS`), the resolved
    config dict and checkpoint header, the versions of torch, transformers, peft and bitsandbytes (or their
    absence) and the bytes of every file of the vramtrace package (a change to any rule starts new keys). So a
    cached outcome is the outcome of the same trace: exact, not an estimate. The report's use_cache false peak
    reads it too (`vramtrace.pipeline._use_cache_false_peak`).

    Only CUDA targets are cached (a CPU target's trace measures this machine's kernels), and never a spec that
    runs code the key does not hold: a custom module (`path/model.py:NAME`), a model passed in-process, a
    `--step` function, `--trust-remote-code`. Failures are not cached, nor a whole pipeline decided by one stage
    (`Evaluator.decided`: an answer for its budget only), so every outcome here answers every caller: another
    budget, `vramtrace fit`, the use_cache false figure. Best effort: a file it cannot read or write
    is a miss. Where: `path` (`VRAMTRACE_LEVER_CACHE`, default $XDG_CACHE_HOME/vramtrace/levers, else
    ~/.cache/vramtrace/levers); off: `VRAMTRACE_LEVER_CACHE=off`; to clear it, delete the directory."""

    def __init__(self, path, resolved) -> None:
        self.path, self.resolved = path, resolved
        self._base_key: bytes | None = None

    @classmethod
    def from_environment(cls, resolved) -> "LeverDiskCache":
        import os
        from pathlib import Path

        where = os.environ.get(LEVER_CACHE_ENV, "")
        if where.lower() == "off":
            return cls(None, resolved)
        try:
            base = Path(where) if where else (
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vramtrace" / "levers")
        except RuntimeError:  # no home directory
            return cls(None, resolved)
        return cls(base, resolved)

    def _key(self, spec: RunSpec) -> str | None:
        import dataclasses
        import hashlib
        import importlib.metadata
        import json
        from pathlib import Path

        if (self.path is None or spec.device is not Device.CUDA or custom_ref(spec.model) is not None
                or spec.step is not None or spec.trust_remote_code):  # custom_ref: an in-process module too
            return None
        if self._base_key is None:
            h = hashlib.sha256()
            for dist in ("torch", "transformers", "peft", "bitsandbytes"):
                try:
                    h.update(f"{dist}={importlib.metadata.version(dist)};".encode())
                except importlib.metadata.PackageNotFoundError:
                    h.update(f"{dist} absent;".encode())
            package = Path(__file__).resolve().parent
            for f in sorted(package.rglob("*")):
                if f.is_file() and f.suffix in (".py", ".json", ".j2", ".js"):
                    h.update(str(f.relative_to(package)).encode() + b"\0" + f.read_bytes())
            h.update(json.dumps(self.resolved.config, sort_keys=True, default=str).encode())
            h.update(repr(self.resolved.checkpoint).encode())
            self._base_key = h.digest()
        fields = [(f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.name not in _VERDICT_FIELDS]
        return hashlib.sha256(self._base_key + repr(fields).encode()).hexdigest()

    def get(self, spec: RunSpec) -> Outcome | None:
        import json

        try:
            key = self._key(spec)
            if key is None:
                return None
            return Outcome(**json.loads((self.path / f"{key}.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def put(self, spec: RunSpec, out: Outcome) -> None:
        import dataclasses
        import json
        import os

        try:
            key = self._key(spec)
            if key is None:
                return
            self.path.mkdir(parents=True, exist_ok=True)
            tmp = self.path / f"{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(dataclasses.asdict(out)), encoding="utf-8")
            os.replace(tmp, self.path / f"{key}.json")  # whole or not at all, for a process reading beside
        except OSError:
            pass


class Evaluator:
    """Exact traces of variants of one run, by RunSpec, cached: `ev(spec) -> Outcome`. `spec`s are resolved
    (precision set); `seed` adds outcomes already traced (the main run's). A variant that needs an extra that is
    not installed, or whose trace raises, raises `NotTraced` (every time it is asked for, traced once).

    With a budget (`stop_over`, set by the lever search once its base is traced), a whole pipeline (a --pp spec,
    `stage` None) is traced stage by stage, in `trace_order`, and stops at the first stage whose outcome does not
    fit it (`pipeline_outcome`); its outcome is then that stage's, `decided[spec]` that stage. Such an outcome
    answers only "does it fit this budget" (no): it is never put in the disk cache, and is dropped when the budget
    changes."""

    def __init__(self, session: TraceSession, cuda: bool) -> None:
        self.session, self.cuda, self.say = session, cuda, session.say
        self.cache: dict[RunSpec, Outcome | NotTraced] = {}
        self.base: RunSpec | None = None  # the progress messages name the options that differ from it
        self.traces = 0
        self.cached = 0  # outcomes found in the disk cache instead of traced
        self.disk = LeverDiskCache.from_environment(session.resolved)
        self.budget: int | None = None  # a whole pipeline's tracing stops at a stage over it (None: every stage)
        self.decided: dict[RunSpec, int] = {}  # a whole pipeline decided by one stage: that stage

    def stop_over(self, budget: int | None) -> None:
        """Trace a whole pipeline only until a stage does not fit `budget` (`search.fits_budget`; None: every
        stage); the outcomes decided by one stage under another budget are dropped (traced again when asked)."""
        if budget != self.budget:
            for spec in self.decided:
                self.cache.pop(spec, None)
            self.decided.clear()
        self.budget = budget

    def trace_order(self, spec: RunSpec) -> Callable[[int], tuple] | None:
        """The order in which the stages of the whole pipeline `spec` are traced under a budget (a sort key of a
        stage), from the base run's stage outcomes this evaluator holds (the report's own traces, `whole_pipeline`):
        `stage_order`. None (the stages in order) without them."""
        base = self.base
        if base is None or base.pp is None:
            return None
        whole = replace(base, stage=None)
        figures = {t.stage: (compared_bytes(o), o.peak_allocated_bytes) for t, o in self.cache.items()
                   if isinstance(o, Outcome) and t.pp is not None and t.stage is not None
                   and replace(t, stage=None) == whole}
        return stage_order(figures, base.pp, spec.pp) if figures else None

    def seed(self, spec: RunSpec, out: Outcome) -> None:
        self.cache[spec] = out

    def options(self, spec: RunSpec) -> str:
        """The command-line options by which `spec` differs from the base run."""
        if self.base is None:
            return ""
        diff = {f: getattr(spec, f) for f in ("use_cache", "optimizer_impl", "checkpointing", "batch", "grad_accum",
                                              "lora_rank", "fsdp", "optimizer", "quantization", "zero", "pp",
                                              "micro_batches", "stage")
                if getattr(spec, f) != getattr(self.base, f)}
        if "batch" in diff or "grad_accum" in diff:
            diff.update(batch=spec.batch, grad_accum=spec.grad_accum)
        return options_text(diff)

    def __call__(self, spec: RunSpec) -> Outcome:
        if spec not in self.cache:
            self.cache[spec] = self._trace(spec)
        out = self.cache[spec]
        if isinstance(out, NotTraced):
            raise out
        return out

    def _trace(self, spec: RunSpec) -> Outcome | NotTraced:
        from .tables import outcome

        options = self.options(spec)
        missing = missing_extras(spec)
        if missing:
            return NotTraced(SkipReason.NEEDS_EXTRA, options, needs_text(missing))
        found = self.disk.get(spec)
        if found is not None:
            self.cached += 1
            return found
        if self.base is not None:
            self.say(f"what makes it fit, trace {self.traces + 1}: {options}")
        made_traces, decided = 1, None
        try:
            if spec.pp is not None and spec.stage is None:  # the whole pipeline: its largest stage
                order = self.trace_order(spec) if self.budget is not None else None
                out, made_traces, decided = pipeline_outcome(self.session, spec, self.cuda, self.budget, order)
            else:
                made = self.session.fresh(spec)  # not kept: only its outcome is
                out = outcome(made.tables, made.num_layers, self.cuda)
        except Exception as e:  # noqa: BLE001 - any failure of one lever's trace must not lose the report
            logging.getLogger(__name__).debug("the lever %s could not be traced", options, exc_info=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
            return NotTraced(SkipReason.FAILED, options, f"could not be traced: {type(e).__name__}: {first}")
        self.traces += made_traces  # a whole pipeline: each of its stages traced
        if decided is None:
            self.disk.put(spec, out)
        else:
            self.decided[spec] = decided
        return out


class _Search:
    """The state the families share: the base spec, its outcome, the budget and the evaluator."""

    def __init__(self, spec: RunSpec, ev: Evaluator, budget: int) -> None:
        self.spec, self.ev, self.budget = spec, ev, budget
        ev.base = spec
        ev.stop_over(None)  # the base run: every stage (it is the report's own, seeded, when a whole pipeline)
        self.base = ev(spec)
        ev.stop_over(budget)

    def fits(self, out: Outcome) -> bool:
        return fits_budget(out, self.budget)

    def lever(self, family: str, on: RunSpec, changes: dict, rank: tuple[int, float], cost: str) -> Lever:
        if on.pp is not None and on.stage is not None:  # --stage K: the lever sized on that stage alone
            k = changes.get("stage", on.stage)  # a deeper pipeline's last stage for the last
            cost += f" (stage {k} only, as --stage{'' if k == on.stage else f' {on.stage} of {on.pp}'})"
        spec = replace(on, **changes)
        try:
            out = self.ev(spec)
        except NotTraced as e:  # named by the lever's own options
            raise NotTraced(e.reason, options_text(changes), e.detail) from e
        return Lever(family, tuple(changes.items()), rank, cost, out, self.fits(out), self.ev.decided.get(spec))


def _use_cache(s: _Search, on: RunSpec) -> list[Lever]:
    """`--use-cache false` when the config's KV cache is live at the peak (else it saves nothing at the peak)."""
    if on.mode is not Mode.TRAIN or on.use_cache is not None or not s.ev(on).kv_cache_bytes_at_peak:
        return []
    return [s.lever("use_cache", on, {"use_cache": False}, (0, 0.0),
                    "none: a training step never reads the KV cache")]


_IMPL_COST = {OptimizerImpl.FUSED: (0, "none: the same update in one fused kernel per parameter group"),
              OptimizerImpl.FOREACH: (0, "none: the same update in multi-tensor kernels"),
              OptimizerImpl.FORLOOP: (1, "a slower optimizer step: one kernel per tensor and op, no multi-tensor "
                                         "temporaries")}


def _optimizer_impl(s: _Search, on: RunSpec) -> list[Lever]:
    """The optimizer's other implementations (torch.optim's foreach / for-loop / fused), when the peak is in the
    optimizer step (elsewhere they change nothing)."""
    if on.mode is not Mode.TRAIN or on.step is not None or s.ev(on).peak_phase != "optimizer":
        return []
    current = on.optimizer_impl
    if current is OptimizerImpl.DEFAULT:  # torch/optim/optimizer.py::_default_to_fused_or_foreach
        current = OptimizerImpl.FOREACH if on.device is Device.CUDA else OptimizerImpl.FORLOOP
    out = []
    for impl in OPTIMIZER_IMPLS[on.optimizer]:
        if impl not in (OptimizerImpl.DEFAULT, current):
            cls, cost = _IMPL_COST[impl]
            out.append(s.lever("optimizer_impl", on, {"optimizer_impl": impl}, (cls, 0.0), cost))
    return out


def _checkpointing(s: _Search, on: RunSpec) -> list[Lever]:
    """The checkpointing plans the planner's search traces (`planner.search_checkpointing`: selective, layers,
    and the fewest every_n_layers that fits), when the run has no checkpointing and a layer stack. Under --pp:
    `PP_CHECKPOINTING`, each decoder layer of every stage (transformers' policies need a `PreTrainedModel`,
    which a stage is not: docs/pipelining.md); `PP_CHECKPOINTING_RANK` when a rank holds several stages."""
    base = s.ev(on)
    if on.mode is not Mode.TRAIN or on.checkpointing.kind is not CheckpointingKind.NONE or not base.num_layers:
        return []
    if on.pp is not None:
        pattern = PP_CHECKPOINTING_RANK if on.pp_schedule.multi_stage else PP_CHECKPOINTING
        lv = s.lever("checkpointing", on, {"checkpointing": pattern}, (2, 0.0), "")
        return [replace(lv, rank=(2, lv.outcome.recompute_overhead),
                        cost=f"recompute: {100 * lv.outcome.recompute_overhead:.1f}% more FLOPs in the backward, "
                             "each decoder layer of every stage checkpointed" + lv.cost)]
    seen: dict[str, Outcome] = {"none": base}

    def evaluate(policy: str) -> Outcome:
        if policy not in seen:
            seen[policy] = s.ev(replace(on, checkpointing=policy))
        return seen[policy]

    search_checkpointing(base.num_layers, lambda p: s.fits(evaluate(p)), evaluate)
    return [s.lever("checkpointing", on, {"checkpointing": policy}, (2, out.recompute_overhead),
                    f"recompute: {100 * out.recompute_overhead:.1f}% more FLOPs in the backward" if out.recompute_flops
                    else "recompute: elementwise ops only (no matmul or attention FLOPs)")
            for policy, out in seen.items() if policy != "none"]


def _micro_batch(s: _Search, on: RunSpec) -> list[Lever]:
    """The largest micro-batch b that divides the batch and fits, with `--grad-accum` raised to keep the effective
    batch (the peak grows with b, so the divisors are bisected); the smallest (b = 1) when none fits."""
    if on.mode is not Mode.TRAIN or on.step is not None or on.batch <= 1:
        return []
    if on.pp is not None:
        return _pp_micro_batches(s, on)
    divisors = [b for b in range(1, on.batch) if on.batch % b == 0]

    def lever(b: int) -> Lever:
        k = on.grad_accum * on.batch // b
        return s.lever("micro_batch", on, {"batch": b, "grad_accum": k}, (3, float(k)),
                       f"throughput: {k} micro-batches of {b} per optimizer step (the same effective batch "
                       f"{on.batch * on.grad_accum})")

    lo, hi, best = 0, len(divisors) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = lever(divisors[mid])
        if cand.fits:
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    return [best or lever(1)]


# the micro-batch counts under --pp beyond the doublings of M that the lever tries, at most: every divisor above M of
# every batch up to 32 rows (30 at M = 2 has the most: 3, 5, 6, 10, 15, 30, none a doubling) is tried; a batch with
# more keeps the smallest (the cheapest M that fits is the one wanted) and its largest (the strongest lever). Each
# is a whole-pipeline trace (every distinct stage): the family makes at most one per doubling of M (what it tried
# when it only doubled M) plus these 6.
PP_MICRO_BATCH_EXTRA = 6


def pp_micro_batch_candidates(batch: int, m: int, accepts: Callable[[int], bool] = lambda _m: True) -> list[int]:
    """The micro-batch counts M' > `m` the --pp micro-batch lever tries for a pipeline step of `batch` rows, in
    ascending order: every divisor of `batch` above `m` that `accepts` (the spec's checks, `accepted`), of which the
    doublings of `m` (m·2, m·4, ... that divide the batch) always, the others at most `PP_MICRO_BATCH_EXTRA` (the
    smallest, and the largest)."""
    divisors = [d for d in range(m + 1, batch + 1) if batch % d == 0 and accepts(d)]
    doublings = [d for d in divisors if d % m == 0 and (d // m) & (d // m - 1) == 0]
    others = [d for d in divisors if d not in doublings]
    if len(others) > PP_MICRO_BATCH_EXTRA:
        others = others[:PP_MICRO_BATCH_EXTRA - 1] + others[-1:]
    return sorted(doublings + others)


def _pp_micro_batches(s: _Search, on: RunSpec) -> list[Lever]:
    """Under --pp: more micro-batches per pipeline step (`--micro-batches`), each of fewer rows, the batch of one
    `schedule.step` kept (--grad-accum does not compose with --pp: the micro-batches are its accumulation). The
    counts of `pp_micro_batch_candidates` (divisors of the batch above the run's M that the spec's checks accept:
    an interleaved schedule's refuse some, as torch's `ScheduleInterleaved1F1B` does), each traced in ascending
    order until one fits; the largest when none does. Under GPipe too: all M micro-batches are in flight there, but
    each of fewer rows, so a stage's per-micro-batch temporaries shrink."""
    m = on.pp_micro_batches
    found = None
    for more in pp_micro_batch_candidates(on.batch, m, lambda k: accepted(on, micro_batches=k) is not None):
        found = s.lever("micro_batch", on, {"micro_batches": more}, (3, float(more)),
                        f"throughput: {more} micro-batches of {on.batch // more} rows per pipeline step instead of "
                        f"{m} of {on.batch // m} (the same batch {on.batch} per schedule.step, smaller "
                        "micro-batches: less of each in flight, lower GPU utilisation)")
        if found.fits:
            break
    return [found] if found is not None else []


def _lora(s: _Search, on: RunSpec) -> list[Lever]:
    """peft LoRA of rank `LORA_RANK` on peft's default targets, for full fine-tuning of a transformers model."""
    if on.mode is not Mode.TRAIN or on.lora_rank is not None or on.freeze or custom_ref(on.model) is not None \
            or on.compile:  # --compile with LoRA is not traced yet (RunSpec refuses it)
        return []
    return [s.lever("lora", on, {"lora_rank": LORA_RANK}, (4, 0.0),
                    f"a different training: LoRA r={LORA_RANK} adapters on peft's default targets, the base "
                    "weights frozen")]


def _optimizer_8bit(s: _Search, on: RunSpec) -> list[Lever]:
    """bitsandbytes' 8-bit AdamW (`--optimizer adamw-8bit`, HF Trainer's `adamw_bnb_8bit`) for torch's Adam or
    AdamW: the same update with blockwise-quantized states (2 bytes per parameter instead of 8). Needs bitsandbytes
    installed (else `NotTraced`)."""
    if on.mode is not Mode.TRAIN or on.optimizer not in (OptimizerKind.ADAMW, OptimizerKind.ADAM) \
            or on.world is not None or on.compile:  # not traced with --compile
        return []
    return [s.lever("optimizer_8bit", on, {"optimizer": OptimizerKind.ADAMW_8BIT,
                                           "optimizer_impl": OptimizerImpl.DEFAULT}, (1, 1.0),
                    "8-bit optimizer states: bitsandbytes' AdamW8bit (blockwise-quantized moments, 2 bytes per "
                    "parameter instead of 8)")]


def _qlora(s: _Search, on: RunSpec) -> list[Lever]:
    """QLoRA: the base weights in 4-bit NF4 with double quantization and bf16 compute (the QLoRA paper's and
    peft's recipe), with LoRA (the run's rank, or `LORA_RANK`) on a transformers model. Needs bitsandbytes."""
    if on.mode is not Mode.TRAIN or on.quantization is not None or on.freeze or on.world is not None \
            or on.step is not None or custom_ref(on.model) is not None or on.compile:  # --compile with quantization is not traced yet
        return []
    changes = {"quantization": "nf4", "double_quant": True, "bnb_compute_dtype": "bf16"}
    if on.lora_rank is None:
        changes["lora_rank"] = LORA_RANK
    # kept as it is: without the option QLoRA gets peft's default checkpointing
    if on.checkpointing.kind is CheckpointingKind.NONE:
        changes["checkpointing"] = "none"  # (spec.KBIT_TRAINING_CHECKPOINTING); another lever's setting wins
    return [s.lever("qlora", on, changes, (4, 1.0),
                    f"a different training: QLoRA, LoRA r={on.lora_rank or LORA_RANK} on 4-bit NF4 base weights "
                    "(double quantization, bf16 compute)")]


def _sharding(s: _Search, on: RunSpec) -> list[Lever]:
    """FSDP2 over N GPUs (`--fsdp N`, the per-rank batch kept): the smallest power of two
    2 <= N <= `search.MAX_RANKS` that fits (`search.fewest_ranks`), or MAX_RANKS when none does. Each N is traced
    at rank 0, whose shards are the largest (ceil(dim0 / N) rows of every parameter, `sharding.rank_classes`)."""
    distributed = on.world is not None or on.quantization is not None  # bitsandbytes weights are not sharded yet
    if on.mode is not Mode.TRAIN or distributed or on.step is not None or custom_ref(on.model) is not None \
            or on.compile or not s.ev(on).num_layers:  # --compile with --fsdp is not traced yet
        return []

    def lever(n: int) -> Lever:
        return s.lever("fsdp", on, {"fsdp": n}, (5, float(n)),
                       f"hardware: {n} GPUs (FSDP2), each step all-gathers every layer's parameters (twice with "
                       "reshard after forward) and reduce-scatters the gradients")

    return [lever(fewest_ranks(lambda n: lever(n).fits, smallest=2) or MAX_RANKS)]


def _zero_stage(s: _Search, on: RunSpec) -> list[Lever]:
    """A higher DeepSpeed ZeRO stage at the run's `--dp` (`--zero`): the smallest stage above the run's that fits,
    or 3 when none does. Only for a --zero run (its --dp is the hardware the user has)."""
    if on.zero is None or on.zero == 3:
        return []

    def lever(stage: int) -> Lever:
        sharded = {2: "the gradients", 3: "the gradients and the parameters"}[stage]
        return s.lever("zero", on, {"zero": stage}, (5, float(stage)),
                       f"DeepSpeed ZeRO-{stage} on the same {on.dp} GPUs: also shards {sharded} (more communication)")

    for stage in range(on.zero + 1, 4):
        found = lever(stage)
        if found.fits:
            return [found]
    return [found]


def pipeline_depth(spec: RunSpec, depth: int, num_layers: int, stage: int | None = None) -> RunSpec | None:
    """`spec` (a --pp run without --pp-split) at pipeline depth `depth` (`pp`), its stage `stage`, or None when
    `depth` is no valid depth for it (pp_options.py `check_pipeline`): more stages (depth × virtual stages) than
    the `num_layers` decoder layers, a batch that does not split into the micro-batches, or any other pipeline the
    spec's own checks refuse (an M that torch's `ScheduleInterleaved1F1B` refuses). The micro-batches M: the
    run's `--micro-batches` when given and valid; 1F1B needs M >= depth (torch's `Schedule1F1B.__init__`), so a
    given M below the depth becomes the depth; M defaulted (None: M = P) follows the depth. The even split of the
    depth (no --pp-split)."""
    from .choices import PipelineSchedule

    if depth * (spec.pp_virtual_stages or 1) > num_layers:  # no stage without layers
        return None
    m = spec.micro_batches
    if m is not None and spec.pp_schedule is PipelineSchedule.ONE_F_ONE_B and m < depth:
        m = depth
    if spec.batch % (m or depth):
        return None
    return accepted(spec, pp=depth, micro_batches=m, stage=stage)


def accepted(spec: RunSpec, **changes) -> RunSpec | None:
    """`spec` with `changes`, or None when its own checks refuse them (a SpecError: pp_options.py
    `check_pipeline`)."""
    from .errors import SpecError

    try:
        return replace(spec, **changes)
    except SpecError:
        return None


def largest_stage(outcomes: list[Outcome]) -> Outcome:
    """The outcome of a pipeline's stages that decides whether it fits: the largest on the verdict's basis
    (`search.compared_bytes`), then by peak allocated."""
    return max(outcomes, key=lambda o: (compared_bytes(o), o.peak_allocated_bytes))


def pipeline_outcome(session: TraceSession, spec: RunSpec, cuda: bool, budget: int | None = None,
                     order: Callable[[int], tuple] | None = None) -> tuple[Outcome, int, int | None]:
    """(the `tables.Outcome` of the pipeline `spec`, the stage traces made, the stage that decided it or None) (a
    --pp spec; `stage` None: every distinct stage traced, pp_stages.py `stage_traces`, not kept): its largest
    stage's on the verdict's basis (`search.compared_bytes`: peak reserved on a CUDA target), so that it fits the
    budget exactly when every stage does. With `spec.stage`: that stage's.

    With `budget`: the stages traced in `order` (a sort key of a stage: `stage_order`; None: in order) until one
    does not fit it (`search.fits_budget`, the lever search's verdict, `_Search.fits`) while others are left: the
    pipeline does not fit, whatever they hold, so they are not traced; the outcome is then that stage's (a lower
    bound of the largest stage's) and the third value that stage. A pipeline that fits, or whose last stage traced
    is the first that does not, has every stage traced and the same outcome as without a budget."""
    from .pp_stages import stage_traces
    from .tables import outcome

    found: dict[int, Outcome] = {}
    decided: list[int] = []

    def judged(k: int, trace, left: int) -> bool:
        found[k] = outcome(trace.tables, trace.num_layers, cuda)
        if budget is not None and left and not fits_budget(found[k], budget):
            decided.append(k)
        return bool(decided)

    stage_traces(session, spec, keep=False, order=order, stop=judged)
    if decided:
        return found[decided[0]], len(found), decided[0]
    return largest_stage(list(found.values())), len(found), None


def stage_order(figures: dict[int, tuple[int, int]], base_depth: int, depth: int) -> Callable[[int], tuple]:
    """The order in which a lever's pipeline of `depth` stages is traced when one stage that does not fit ends it
    (`pipeline_outcome`): a sort key of stage j, its stages by the figures of the base run's stage at the same
    relative position, largest first (then by j). `figures`: {stage k: (its `search.compared_bytes`, its peak
    allocated bytes, which breaks ties of peak reserved, a multiple of the allocator's segments)} of the base run's
    traced stages (one of each class, `pp_stages.trace_classes`), a pipeline of `base_depth` stages; stage j takes
    the figures of the traced stage k whose relative position k / (base_depth - 1) is nearest its j / (depth - 1)
    (the first stage the first's, the last the last's).

    Why: a lever changes a pipeline's stages alike (its checkpointing, optimizer, micro-batches on every stage; a
    deeper pipeline spreads the same layers), so the stage that held the most in the base run (under 1F1B the first,
    with the most micro-batches in flight, torch's `Schedule1F1B` warmup; or the last, with the head's logits and
    the loss) is the most likely to hold the most, and so to not fit, in the lever's: a lever that does not fit is
    then usually decided by its first trace."""
    def nearest(j: int) -> int:  # |k/(base_depth-1) - j/(depth-1)| compared over a common denominator, in integers
        return min(figures, key=lambda k: (abs(k * max(depth - 1, 1) - j * max(base_depth - 1, 1)), k))

    return lambda j: (*(-b for b in figures[nearest(j)]), j)


def _pipeline_depth(s: _Search, on: RunSpec) -> list[Lever]:
    """A deeper pipeline (`--pp`), only for a --pp run without --pp-split (its P is the hardware the user has;
    a split fixes the depth): the smallest depth P' in P + 1 .. 2P (at most twice the GPUs; `vramtrace fit --pp`
    searches every depth) that fits, each traced in order with the candidate rules of the fit axis
    (`pipeline_depth`: at most the decoder layers, the batch split into its micro-batches); the deepest traced
    when none fits. With --stage K, stage K of the deeper pipeline, the last stage's as the last (P' - 1)."""
    if on.pp is None or on.pp_split is not None:
        return []
    layers = s.ev(on).num_layers
    found = None
    for depth in range(on.pp + 1, 2 * on.pp + 1):
        # --stage K: the same stage of the deeper pipeline (the last stays the last: it holds the head and the loss)
        stage = depth - 1 if on.stage == on.pp - 1 else on.stage
        deeper = pipeline_depth(on, depth, layers, stage)
        if deeper is None:
            continue
        changes = {"pp": depth}
        if deeper.micro_batches != on.micro_batches:
            changes["micro_batches"] = deeper.micro_batches
        if stage != on.stage:
            changes["stage"] = stage
        found = s.lever("pp", on, changes, (5, float(depth)),
                        f"hardware: {depth} pipeline stages ({depth} GPUs) instead of {on.pp}, "
                        f"{deeper.pp_micro_batches} micro-batches, the layers split evenly")
        if found.fits:
            break
    return [found] if found is not None else []


def whole_pipeline(ev: Evaluator, spec: RunSpec) -> RunSpec:
    """The spec whose levers a --pp report lists when the user did not pass --stage: `spec` (the reported stage's)
    with `stage` None, seeded into `ev` with its largest stage's outcome (`pipeline_outcome`'s basis) from the stage
    outcomes `ev` holds (the report's own traces: every distinct stage), so that it is not traced again."""
    whole = replace(spec, stage=None)
    stages = [o for t, o in ev.cache.items() if isinstance(o, Outcome) and t.pp is not None and t.stage is not None
              and replace(t, stage=None) == whole]
    if stages:
        ev.seed(whole, largest_stage(stages))
    return whole


# the families a --zero run tries (the others change what DeepSpeed runs: LoRA, quantization, FSDP2, the optimizer)
ZERO_FAMILIES = ("use_cache", "checkpointing", "micro_batch", "zero")
# the families a --pp run tries, each on the whole pipeline (every stage; --stage K: that stage): --pp does not
# compose with LoRA, quantization or FSDP2 yet
PP_FAMILIES = ("use_cache", "optimizer_impl", "optimizer_8bit", "checkpointing", "micro_batch", "pp")
PP_CHECKPOINTING = "modules:layers.*"  # each decoder layer of a stage (docs/pipelining.md)
# under interleaved-1f1b and zero-bubble a rank's stages are `stage<k>` of one module (tracer/pipelining.py RankModule)
PP_CHECKPOINTING_RANK = "modules:stage*.layers.*"

FAMILIES: tuple[tuple[str, Callable[[_Search, RunSpec], list[Lever]]], ...] = (
    ("use_cache", _use_cache), ("optimizer_impl", _optimizer_impl), ("optimizer_8bit", _optimizer_8bit),
    ("checkpointing", _checkpointing), ("micro_batch", _micro_batch), ("lora", _lora), ("qlora", _qlora),
    ("fsdp", _sharding), ("zero", _zero_stage), ("pp", _pipeline_depth),
)


# under --pp, the families not in PP_FAMILIES (one skipped row says why)
PP_NOT_TRACED = "not traced under --pp yet: --pp does not compose with LoRA, QLoRA or FSDP2 yet"


def find_levers(spec: RunSpec, ev: Evaluator, budget_bytes: int) -> LeversSummary:
    """The levers of `spec` (resolved: precision set; a --pp spec with `stage` None sizes the whole pipeline, its
    largest stage: `pipeline_outcome`, `whole_pipeline`) against `budget_bytes` (on `search.compared_bytes`'s basis),
    as the report's `levers` section: the levers ranked (`Lever.row`), the combination (`_combine`), the traces
    made, the families skipped (`NotTraced.row`: an extra missing, its trace failed; those not traced under --pp)
    and the outcomes found in the disk cache (`LeverDiskCache`). Levers that save nothing are left out."""
    s = _Search(spec, ev, budget_bytes)
    base_bytes = compared_bytes(s.base)
    found: list[Lever] = []
    skipped: list[SkippedLever] = []
    if spec.pp is not None:
        skipped.append(NotTraced(SkipReason.NOT_MODELLED, "--lora-rank / --quantization / --fsdp",
                                 PP_NOT_TRACED).row("not_under_pp"))
    for name, family in FAMILIES:
        if (spec.zero is not None and name not in ZERO_FAMILIES) or (spec.pp is not None and name not in PP_FAMILIES):
            continue
        try:
            found += [lv for lv in family(s, spec) if compared_bytes(lv.outcome) < base_bytes]
        except NotTraced as e:
            skipped.append(e.row(name))
    found.sort(key=lambda lv: (lv.rank, compared_bytes(lv.outcome)))
    combination = None
    if not any(lv.fits for lv in found):
        try:
            combination = _combine(s, found)
        except NotTraced as e:
            skipped.append(e.row("combination"))
    # skipped and cached are left out of the JSON when empty: the reports of a run with every lever traced stay as
    # they were; cached counts the outcomes read from `LeverDiskCache`, each of the same trace made before
    return LeversSummary(budget_bytes=budget_bytes, base_bytes=base_bytes, basis=basis_text(s.base),
                         levers=tuple(lv.row(base_bytes) for lv in found), combination=combination,
                         traces=ev.traces, skipped=tuple(skipped), cached=ev.cached or None)


def _merged(levers) -> dict:
    """The RunSpec changes of `levers` together; for a field two levers set, the first's value (QLoRA's
    'checkpointing none', which only keeps the run's, comes after the checkpointing family in `FAMILIES`)."""
    out: dict = {}
    for lv in levers:
        for k, v in lv.changes:
            out.setdefault(k, v)
    return out


def _combine(s: _Search, found: list[Lever]) -> LeverCombination | None:
    """The cheapest combination found that fits (see the module docstring), or the strongest one when nothing
    fits; None when fewer than two levers save anything.

    Free levers that save on the run are in from the start. Each non-free family's strongest lever is added in
    rank order until the combination fits; a lever can move the peak into the optimizer step (checkpointing
    does), so when the combination's peak is there, the optimizer's other implementations are traced on it too.
    Then the levers the fit does not need are dropped (most expensive first), and checkpointing and the
    micro-batch are relaxed to the cheapest setting traced for them that still fits."""
    if len(found) < 2:
        return None
    chosen: dict[str, Lever] = {}
    by_family: dict[str, list[Lever]] = {}
    for lv in found:
        by_family.setdefault(lv.family, []).append(lv)
        if lv.rank[0] == 0 and lv.family not in chosen:
            chosen[lv.family] = lv

    def changes() -> dict:
        return _merged(chosen[f] for f, _ in FAMILIES if f in chosen)

    def traced() -> Outcome:
        return s.ev(replace(s.spec, **changes()))

    for f, _ in FAMILIES:
        if s.fits(traced()):
            break
        if f in by_family and by_family[f][0].rank[0] > 0 and f not in chosen:
            chosen[f] = min(by_family[f], key=lambda lv: compared_bytes(lv.outcome))
            try:
                replace(s.spec, **changes())
            except UsageError:  # options that do not go together (QLoRA and FSDP; 8-bit and a fused optimizer)
                del chosen[f]
                continue
            if "optimizer_impl" not in chosen and traced().peak_phase == "optimizer":
                on = replace(s.spec, **changes())
                impls = [lv for lv in _optimizer_impl(s, on) if compared_bytes(lv.outcome) < compared_bytes(traced())]
                if impls:
                    chosen["optimizer_impl"] = min(impls, key=lambda lv: (lv.rank, compared_bytes(lv.outcome)))
    if s.fits(traced()):
        # drop what the fit does not need, most expensive first (free levers too: fewer options to apply)
        for f in sorted(chosen, key=lambda f: chosen[f].rank, reverse=True):
            kept = chosen.pop(f)
            if not s.fits(traced()):
                chosen[f] = kept
        for f in ("checkpointing", "micro_batch"):  # the cheapest setting traced for it that still fits
            for lv in sorted(by_family.get(f, ()), key=lambda lv: lv.rank):
                if f not in chosen or lv.rank >= chosen[f].rank:
                    break
                kept, chosen[f] = chosen[f], lv
                if s.fits(traced()):
                    break
                chosen[f] = kept
    out = traced()
    order = [f for f, _ in FAMILIES if f in chosen]
    return LeverCombination(options=options_text(_merged(chosen[f] for f in order)), levers=tuple(order),
                            peak_allocated_bytes=out.peak_allocated_bytes,
                            peak_reserved_bytes=out.peak_reserved_bytes, compared_bytes=compared_bytes(out),
                            fits=s.fits(out), decided_by_stage=s.ev.decided.get(replace(s.spec, **changes())))
