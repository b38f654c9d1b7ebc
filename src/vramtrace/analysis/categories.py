"""Storage categories, as readable str enums (the style of torch/distributed/_tools/mem_tracker.py)."""

from __future__ import annotations

import enum


class Category(str, enum.Enum):
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"  # saved for backward by autograd during the forward
    TEMPORARY = "temporary"
    INPUT = "input"  # inputs and module buffers


# Categories whose storages must outlive the step even under last-use freeing (graph-optimal figure).
PERSISTENT = frozenset({Category.PARAMETER, Category.OPTIMIZER_STATE, Category.INPUT})
