"""vramtrace: exact, static memory prediction of a training step from a meta-device trace.

Public API: `analyze(spec) -> MemoryReport`; `check(trainer) -> MemoryReport` for an HF Trainer. This module only re-exports: the orchestration is in `pipeline.py`,
the report's `run`/`checkpointing`/`compiled` entries in `summaries.py`, the version in `_version.py`.
"""

from __future__ import annotations

from ._version import __version__
from .errors import VramtraceError
from .pipeline import COMPARED_POLICIES, analyze, compare, compare_reports, with_comparison
from .spec import KBIT_TRAINING_CHECKPOINTING, Device, Mode, RunSpec  # the first: importable here before pipeline.py
from .summaries import (adapters_summary, checkpointed_modules, checkpointing_summary, compile_summary,
                        cuda_context_summary, moe_summary, sharding_summary, step_summary, target_warnings)
from .render.output import print_report, report_json, write_html

__all__ = ["analyze", "check", "compare", "compare_reports", "with_comparison", "RunSpec", "VramtraceError",
           "__version__", "print_report", "report_json", "write_html"]


def check(trainer, **options):
    """Predict the training step of a `transformers.Trainer` before it runs: `integrations.transformers.check`
    (options: on_oom_risk, seq, headroom, device, gpu, gpu_memory, json_path). Returns the MemoryReport."""
    from .integrations.transformers import check as check_trainer

    return check_trainer(trainer, **options)

