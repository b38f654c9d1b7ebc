"""HTML renderer: one self-contained liveness report (jinja2 template, inline script, no network).

The report's storages are embedded as columnar JSON with a string table (a 7B model's ~10^4 storages and
~10^4 steps stay near a megabyte); the page draws them on canvas. Every name reaches the page as JSON text
inside a `<script type="application/json">` block (every `<` written as `\\u003c`) and is put in the DOM with
`textContent`, so no name is ever parsed as HTML; jinja2 autoescapes everything else.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jinja2
from markupsafe import Markup

from ..analysis.categories import Category
from ..analysis.summary import MemoryReport
from ..errors import ReportWriteError
from ..units import format_bytes

CATEGORY_COLORS = {  # stacked bottom to top in this order
    Category.PARAMETER: "#4c78a8", Category.OPTIMIZER_STATE: "#72b7b2", Category.GRADIENT: "#54a24b",
    Category.INPUT: "#b279a2", Category.KEPT: "#9d755d", Category.AUTOCAST_WEIGHTS: "#bab0ac",
    Category.ACTIVATION: "#f58518", Category.KV_CACHE: "#eeca3b", Category.OUTPUTS: "#ff9da6",
    Category.TEMPORARY: "#e45756", Category.CUBLAS_WORKSPACE: "#79706e",
    Category.UNSHARDED_PARAMETERS: "#1f4e79", Category.COLLECTIVE_BUFFERS: "#a05195",
    Category.QUANTIZED_WEIGHTS: "#2f6f4f", Category.QUANT_CONSTANTS: "#8cd17d", Category.DEQUANTIZED_WEIGHTS: "#d37295",
    Category.PAGED_OPTIMIZER_STATE: "#b6992d",
}


def _payload(report: MemoryReport, label: str) -> dict:
    strings: dict[str, int] = {}

    def s(text: str) -> int:
        return strings.setdefault(text, len(strings))

    cats = list(CATEGORY_COLORS)
    index = {c.value: k for k, c in enumerate(cats)}
    rows = report.tensors
    tensors = {
        "id": [t.id for t in rows], "bytes": [t.bytes for t in rows], "cat": [index[t.category] for t in rows],
        "module": [s(t.module) for t in rows], "op": [s(t.op) for t in rows], "name": [s(t.name) for t in rows],
        "shape": [s("(" + ", ".join(map(str, t.shape)) + ")") for t in rows], "dtype": [s(t.dtype) for t in rows],
        "birth": [t.birth for t in rows], "death": [t.death for t in rows],
    }
    steps = {"op": [s(op) for op, _, _ in report.steps], "module": [s(m) for _, m, _ in report.steps],
             "phase": [s(ph) for _, _, ph in report.steps]}
    bands: list[list] = []
    for i, (_, _, phase) in enumerate(report.steps):
        if bands and bands[-1][0] == phase:
            bands[-1][2] = i
        else:
            bands.append([phase, i, i])
    return {"label": label, "num_steps": report.num_steps, "peak_step": report.peak_step,
            "peak_bytes": report.peak_allocated_bytes, "bands": bands, "steps": steps, "tensors": tensors,
            "strings": list(strings)}


def _summary(report: MemoryReport, label: str) -> dict:
    m, r = report.model, report.run
    fit = report.fit
    ck = report.checkpointing
    return {
        "label": label,
        "model": f"{m['ref']}: {m['architecture']}, {report.params:,} parameters"
                 + (f" ({m['trainable_params']:,} trainable)" if m["trainable_params"] != report.params else "")
                 + f", weights {m['param_dtype']}, compute {m['compute_dtype']}"
                 + (f"; {r['adapters']}" if r.get("adapters") else "")
                 + (f"; checkpoint: {m['checkpoint']['note']}" if m.get("checkpoint") else ""),
        "run": f"{r['mode']}, {r['precision']}, optimizer {r['optimizer']} ({r['optimizer_impl']}), batch {r['batch']}"
               + (f" × seq {r['seq']}" if r.get("seq") else "")
               + (f", image {'×'.join(map(str, r['image_size']))}" if r.get("image_size") else "")
               + f", target {r['device']}" + (f" ({r['gpu']})" if r["device"] == "cuda" else "")
               + f", checkpointing {r['checkpointing']}"
               + (f", MoE routing {r['moe_routing']}" if r.get("moe_layers") else ""),
        "peak": f"{format_bytes(report.peak_allocated_bytes)} ({report.peak_allocated_bytes:,} bytes)",
        "where": f"step {report.peak_step} of {report.num_steps}, {report.peak_phase}: {report.peak_op} in "
                 f"{report.peak_module or '(root)'}",
        "reserved": format_bytes(report.peak_reserved_bytes) if report.peak_reserved_bytes is not None else "",
        "optimal": format_bytes(report.graph_optimal_peak_bytes),
        "first": format_bytes(report.first_step_peak_allocated_bytes),
        "fit": ("" if fit is None else
                f"fits on {fit['gpu']} with {format_bytes(fit['headroom_bytes'])} spare" if fit["fits"] else
                f"does not fit on {fit['gpu']}: over by {format_bytes(-fit['headroom_bytes'])}"),
        "checkpointing": "" if not ck else (
            f"{ck['policy']}: activations {format_bytes(ck['activation_bytes'])} (without: "
            f"{format_bytes(ck['activation_bytes_without'])}), recompute {100 * ck['recompute_overhead']:.1f}% of FLOPs"),
        "phases": [{"name": p.name, "bytes": format_bytes(p.bytes), "step": p.step} for p in report.phases],
    }


def render_html(reports: list[MemoryReport], labels: list[str] | None = None) -> str:
    """The HTML page for one report, or several side by side on one scale (a comparison)."""
    from .. import __version__

    labels = labels or [f"{r.run['checkpointing']}" if len(reports) > 1 else r.model["ref"] for r in reports]
    data = {"categories": [c.value for c in CATEGORY_COLORS], "colors": list(CATEGORY_COLORS.values()),
            "reports": [_payload(r, label) for r, label in zip(reports, labels)]}
    # no "<" at all inside the data block, so no name can end the script or open a comment
    data_json = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    pkg = resources.files("vramtrace.reports") / "templates"
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string((pkg / "report.html.j2").read_text(encoding="utf-8"))
    return template.render(title=" vs ".join(labels), version=__version__,
                           summaries=[_summary(r, lab) for r, lab in zip(reports, labels)],
                           data_json=Markup(data_json), script=Markup((pkg / "report.js").read_text(encoding="utf-8")))


def write_html(reports: list[MemoryReport], path: str, labels: list[str] | None = None) -> None:
    """Write the HTML report to `path`. Raises ReportWriteError."""
    text = render_html(reports, labels)
    try:
        Path(path).expanduser().write_text(text, encoding="utf-8")
    except OSError as e:
        raise ReportWriteError(f"cannot write --html {path}: {e.strerror}") from e
