"""HTML renderer: one self-contained liveness report (jinja2 template, inline script, no network).

The report's storages are embedded as columnar JSON with a string table (a 7B model's ~10^4 storages and
~10^4 steps stay near half a megabyte); the page draws them on canvas: per report a timeline on a GiB axis
shared by all compared reports, with the target GPU's capacity line, the allocator model's reserved curve
(`allocator['reserved_steps']`), phase bands and a brush to zoom; beside it the categories at the peak; below,
the levers that make it fit, and the lifetimes grouped by module (`_lifetime_groups`: identical layers folded
into one row, storages that live the whole step in one band). Every name reaches the page as JSON text
inside a `<script type="application/json">` block (every `<` written as `\\u003c`) and is put in the DOM with
`textContent`, so no name is ever parsed as HTML; jinja2 autoescapes everything else.
"""

from __future__ import annotations

import json
from importlib import resources

import jinja2
from markupsafe import Markup

from ..analysis.aggregate import live_groups, module_pattern, owner, stack_pattern
from ..analysis.categories import Category
from ..report.summary import MemoryReport
from ..report.sections import LeversSummary
from ..units import format_bytes
from ..spec import Device
from .json_report import write_output
from .terminal import image_text

CATEGORY_COLORS = {  # stacked bottom to top in this order
    Category.PARAMETER: "#4c78a8", Category.OPTIMIZER_STATE: "#72b7b2", Category.GRADIENT: "#54a24b",
    Category.INPUT: "#b279a2", Category.KEPT: "#9d755d", Category.AUTOCAST_WEIGHTS: "#bab0ac",
    Category.ACTIVATION: "#f58518", Category.KV_CACHE: "#eeca3b", Category.OUTPUTS: "#ff9da6",
    Category.TEMPORARY: "#e45756", Category.CUBLAS_WORKSPACE: "#79706e",
    Category.UNSHARDED_PARAMETERS: "#1f4e79", Category.COLLECTIVE_BUFFERS: "#a05195",
    Category.QUANTIZED_WEIGHTS: "#2f6f4f", Category.QUANT_CONSTANTS: "#8cd17d", Category.DEQUANTIZED_WEIGHTS: "#d37295",
    Category.PAGED_OPTIMIZER_STATE: "#b6992d", Category.ALLOCATOR_REMAINDER: "#d8b5a5",
    Category.PIPELINE_BUFFERS: "#7f7f00",
}


WHOLE_STEP_BAND = "persistent (live the whole step)"  # the band that folds parameters, optimizer states, inputs
AT_PEAK_ROWS = 8  # rows of the "live at the peak, identical layers folded" table


def _fold(path: str) -> tuple[str, str]:
    """(fold key, instance) of a module path: 'model.layers.3.mlp' -> ('model.layers.*', 'model.layers.3'),
    the first layer index folded (`aggregate.module_pattern`); a path without an index is its own key."""
    head = stack_pattern(module_pattern(path))
    if head is None:
        return path or "(root)", path or "(root)"
    depth = head.count(".") + 1
    return head, ".".join(path.split(".")[:depth])


def _index_key(path: str) -> tuple:
    """Sort key that puts 'model.layers.10' after 'model.layers.9'."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _lifetime_groups(report: MemoryReport, cats: list[Category]) -> tuple[dict, list[int]]:
    """The lifetimes panel's tree: storages that live the whole step in one band (WHOLE_STEP_BAND, then by
    category), the others by module, identical layers folded into one node ('model.layers.* ×32') whose children
    are the instances. Returns ({'label', 'parent', 'kind'}: one entry per node, parents before children, kind 'band' |
    'category' | 'fold' | 'module'), and per storage the node it sits in (the deepest)."""
    labels: list[str] = []
    parents: list[int] = []
    kinds: list[str] = []

    def node(label: str, parent: int, kind: str) -> int:
        labels.append(label)
        parents.append(parent)
        kinds.append(kind)
        return len(labels) - 1

    last = report.num_steps - 1
    rows = report.tensors
    persistent = [k for k, t in enumerate(rows) if t.birth <= 0 and t.death >= last]
    pset = set(persistent)
    rest = [k for k in range(len(rows)) if k not in pset]
    rest.sort(key=lambda k: (rows[k].birth, k))  # modules in the order the step first allocates in them
    where = [0] * len(rows)

    def place(members: list[int], parent: int) -> None:
        folds: dict[str, dict[str, list[int]]] = {}
        for k in members:
            key, inst = _fold(owner(rows[k]))
            folds.setdefault(key, {}).setdefault(inst, []).append(k)
        for key, instances in folds.items():
            if len(instances) == 1:
                (inst, ks), = instances.items()
                g = node(inst, parent, "module")
                for k in ks:
                    where[k] = g
                continue
            f = node(f"{key} ×{len(instances)}", parent, "fold")
            for inst in sorted(instances, key=_index_key):
                g = node(inst, f, "module")
                for k in instances[inst]:
                    where[k] = g

    if persistent:
        band = node(WHOLE_STEP_BAND, -1, "band")
        for c in cats:
            members = [k for k in persistent if rows[k].category == c.value]
            if members:
                place(members, node(c.value, band, "category"))
    place(rest, -1)
    return {"label": labels, "parent": parents, "kind": kinds}, where


def _payload(report: MemoryReport, label: str) -> dict:
    strings: dict[str, int] = {}

    def s(text: str) -> int:
        return strings.setdefault(text, len(strings))

    cats = list(CATEGORY_COLORS)
    index = {c.value: k for k, c in enumerate(cats)}
    rows = report.tensors
    groups, where = _lifetime_groups(report, cats)
    tensors = {
        "id": [t.id for t in rows], "bytes": [t.bytes for t in rows], "cat": [index[t.category] for t in rows],
        "module": [s(t.module) for t in rows], "op": [s(t.op) for t in rows], "name": [s(t.name) for t in rows],
        "shape": [s("(" + ", ".join(map(str, t.shape)) + ")") for t in rows], "dtype": [s(t.dtype) for t in rows],
        "birth": [t.birth for t in rows], "death": [t.death for t in rows], "group": where,
    }
    steps = {"op": [s(op) for op, _, _ in report.steps], "module": [s(m) for _, m, _ in report.steps],
             "phase": [s(ph) for _, _, ph in report.steps]}
    bands: list[list] = []
    for i, (_, _, phase) in enumerate(report.steps):
        if bands and bands[-1][0] == phase:
            bands[-1][2] = i
        else:
            bands.append([phase, i, i])
    fit = report.fit
    # the timeline's capacity line: the device less the CUDA context, what the allocator may reserve
    capacity = None if fit is None else {"gpu": fit.gpu, "capacity_bytes": fit.capacity_bytes,
                                         "context_bytes": fit.cuda_context_bytes or 0}
    points = None if report.allocator is None else report.allocator.reserved_steps
    reserved = None if not points else {"step": [p[0] for p in points], "bytes": [p[1] for p in points]}
    return {"label": label, "num_steps": report.num_steps, "peak_step": report.peak_step,
            "peak_bytes": report.peak_allocated_bytes, "capacity": capacity, "reserved": reserved, "bands": bands,
            "steps": steps, "tensors": tensors, "groups": groups, "strings": list(strings)}


def _summary(report: MemoryReport, label: str) -> dict:
    from .levers import pipeline_who

    m, r = report.model, report.run
    fit = report.fit
    ck = report.checkpointing
    return {
        "label": label,
        "model": f"{m.ref}: {m.architecture}, {report.params:,} parameters"
                 + (f" ({m.trainable_params:,} trainable)" if m.trainable_params != report.params else "")
                 + f", weights {m.param_dtype}, compute {m.compute_dtype}"
                 + (f"; {r.adapters}" if r.adapters else "")
                 + (f"; checkpoint: {m.checkpoint.note}" if m.checkpoint else ""),
        "run": f"{r.mode.value}, {r.precision.value}, optimizer {r.optimizer.value} ({r.optimizer_impl.value}), "
               f"batch {r.batch}"
               + (f" × seq {r.seq}" if r.seq else "")
               + image_text(r)
               + f", target {r.device.value}" + (f" ({r.gpu})" if r.device is Device.CUDA else "")
               + f", checkpointing {r.checkpointing}"
               + (f", MoE routing {r.moe_routing}" if r.moe_layers else ""),
        "peak": format_bytes(report.peak_allocated_bytes),
        "peak_exact": f"{report.peak_allocated_bytes:,} bytes",
        "peak_step": report.peak_step,
        "where": f"step {report.peak_step} of {report.num_steps}, {report.peak_phase}: {report.peak_op} in "
                 f"{report.peak_module or '(root)'}",
        "reserved": format_bytes(report.peak_reserved_bytes) if report.peak_reserved_bytes is not None else "",
        "optimal": format_bytes(report.graph_optimal_peak_bytes),
        "first": format_bytes(report.first_step_peak_allocated_bytes),
        "fits": None if fit is None else fit.fits,
        "fit": ("" if fit is None else
                f"fits on {fit.gpu} with {format_bytes(fit.headroom_bytes)} spare" if fit.fits else
                f"does not fit on {fit.gpu}: over by {format_bytes(-fit.headroom_bytes)}"),
        "fit_basis": "" if fit is None else fit.basis,
        "checkpointing": "" if not ck else (
            f"{ck.policy}: activations {format_bytes(ck.activation_bytes)} (without: "
            f"{format_bytes(ck.activation_bytes_without)}), "
            f"recompute {100 * ck.recompute_overhead:.1f}% of FLOPs"),
        "phases": [{"name": p.name, "bytes": format_bytes(p.bytes), "step": p.step} for p in report.phases],
        "breakdown": [{"category": c.value, "color": color, "bytes": format_bytes(report.breakdown_at_peak[c.value]),
                       "share": f"{100 * report.breakdown_at_peak[c.value] / max(report.peak_allocated_bytes, 1):.1f}"}
                      for c, color in CATEGORY_COLORS.items() if report.breakdown_at_peak.get(c.value)],
        "at_peak": [{"pattern": g.pattern or "(root)", "category": g.category, "instances": g.instances,
                     "each": format_bytes(g.bytes_each), "bytes": format_bytes(g.bytes)}
                    for g in live_groups(report.tensors, report.peak_step)[:AT_PEAK_ROWS]],
        "levers": _lever_rows(report.levers, pipeline_who(report)),
    }


def _lever_rows(levers: LeversSummary | None, who: str = "stage") -> dict | None:
    """The levers (`vramtrace.levers.find_levers`) as table rows, this run's peak first and the combination last,
    each with its traced peak on the verdict's basis, what it saves, whether it fits and its bar's width (percent
    of the widest peak or the budget); `budget_at` is where the budget's mark goes, `cheapest` the first row
    that fits (None when none does); `skipped` the levers not traced, each {'options', 'line'} (the extra that
    would add it, or why its trace failed). A row decided by one pipeline stage (`decided_by_stage`) shows its peak
    as a lower bound and what it saves as an upper bound, its cost saying why (`levers.partial_note`, `who`: stage
    or rank)."""
    from .levers import partial_note, skipped_line

    if not levers:
        return None
    base, budget = levers.base_bytes, levers.budget_bytes
    rows = [{"options": "this run", "bytes": base, "fits": base <= budget, "cost": "", "base": True, "stage": None}]
    rows += [{"options": lv.options, "bytes": lv.compared_bytes, "fits": lv.fits,
              "cost": lv.cost + partial_note(lv.decided_by_stage, "; ", who), "base": False,
              "stage": lv.decided_by_stage} for lv in levers.levers]
    combo = levers.combination
    if combo:
        rows.append({"options": combo.options, "bytes": combo.compared_bytes, "fits": combo.fits,
                     "cost": "these levers together" + partial_note(combo.decided_by_stage, "; ", who), "base": False,
                     "stage": combo.decided_by_stage})
    top = max([r["bytes"] for r in rows] + [budget]) or 1
    for r in rows:
        # the options as '--flag value' pieces, so that a line breaks between options, never inside one
        r["parts"] = [p if k == 0 else "--" + p for k, p in enumerate(r["options"].split(" --"))]
        at_least, at_most = ("≥ ", "≤ ") if r.pop("stage") is not None else ("", "")
        r.update(width=f"{100 * r['bytes'] / top:.2f}", peak=at_least + format_bytes(r["bytes"]),
                 saves="" if r["base"] else at_most + format_bytes(base - r["bytes"]))
    cheapest = next((r for r in rows[1:] if r["fits"]), None)  # rows are ranked cheapest first
    return {"rows": rows, "budget": format_bytes(budget), "basis": levers.basis,
            "budget_at": f"{100 * budget / top:.2f}", "cheapest": cheapest,
            "skipped": [{"options": sk.options, "line": skipped_line(sk)} for sk in levers.skipped]}


def render_html(reports: list[MemoryReport], labels: list[str] | None = None) -> str:
    """The HTML page for one report, or several side by side on one scale (a comparison)."""
    from .._version import __version__

    labels = labels or [f"{r.run.checkpointing}" if len(reports) > 1 else r.model.ref for r in reports]
    # the pipeline's category (last, so no other index moves) only on a page with a --pp report
    shown = [c for c in CATEGORY_COLORS if c is not Category.PIPELINE_BUFFERS or any(r.run.pp for r in reports)]
    data = {"categories": [c.value for c in shown], "colors": [CATEGORY_COLORS[c] for c in shown],
            "reports": [_payload(r, label) for r, label in zip(reports, labels)]}
    # no "<" at all inside the data block, so no name can end the script or open a comment
    data_json = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    pkg = resources.files("vramtrace.render") / "templates"
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((pkg / "report.html.j2").read_text(encoding="utf-8"))
    return template.render(title=" vs ".join(labels), version=__version__,
                           summaries=[_summary(r, lab) for r, lab in zip(reports, labels)],
                           data_json=Markup(data_json), script=Markup((pkg / "report.js").read_text(encoding="utf-8")))


def write_html(reports: list[MemoryReport], path: str, labels: list[str] | None = None) -> None:
    """Write the HTML report to `path` ('-' for stdout). Raises ReportWriteError."""
    write_output(path, render_html(reports, labels), "--html")
