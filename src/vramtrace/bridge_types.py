"""The types of the bridge ledger (`vramtrace.bridges`): a `Bridge` declaration and its `BridgeKind`, and the
protocols of what the bridges read of the trace's kernel policy (`KernelPolicy`) and tell its recorder
(`StepRecording`), so that the ledger imports nothing from tracer/."""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sized

if TYPE_CHECKING:
    import torch

    from .spec import Device


class KernelPolicy(Protocol):
    """What the bridges read of the trace's kernel policy (tracer/kernels.py `KernelPolicyMode`): the target
    device and whether the emulated autocast is on now."""

    device: Device
    autocast_dtype: torch.dtype | None  # the emulated autocast's compute dtype (None: no autocast)

    @property
    def autocast_active(self) -> bool: ...

    def autocast_disabled(self) -> contextlib.AbstractContextManager[None]:
        """The emulated autocast off while open (the real `maybe_autocast(..., enabled=False)`)."""


class StepRecording(Protocol):
    """What the bridges tell the trace's recorder (tracer/recorder.py `StepRecorder`) of the allocations they
    see outside the dispatcher."""

    ops: Sized  # the ops recorded so far; a storage born now is born at op len(ops)

    def storage_id(self, t: torch.Tensor, *, op_index: int, op: str, category: str | None = None,
                   name: str = "") -> int:
        """t's storage registered (born at `op_index`, made by `op`) if it is new; its record id."""

    def storage_resized(self, t: torch.Tensor) -> None:
        """t's storage was resized in place (UntypedStorage.resize_)."""

    def device_copy(self) -> contextlib.AbstractContextManager[None]:
        """While open, what an op makes from host storages is on the device (a host-to-device copy)."""

    def set_category(self, t: torch.Tensor, category: str, name: str = "") -> None:
        """t's storage gets `category` and a name."""

    def managed(self, t: torch.Tensor, category: str) -> None:
        """t's storage is memory outside the caching allocator (CUDA managed memory), of `category`."""


class BridgeKind(enum.Enum):
    """What a bridge does with its targets."""

    PATCH = "patch"  # replaces them while they are needed, and puts the originals back
    READ = "read"  # only reads them (calls a private function, takes a private value): nothing is replaced


@dataclass(frozen=True, slots=True)
class Bridge:
    """One patch, or one private read (`kind`). `targets`: ('module', 'attribute') pairs it replaces or reads
    ('Class.method' for a method); `when_absent`: '' (a missing target is a BridgeError) or why the bridge is not
    needed without it; `assigns`: instance attributes a READ bridge reads on the objects its first target's code
    makes them on (`self.<name> = ...`), checked in that code."""

    name: str
    library: str  # 'transformers' | 'torch' | 'bitsandbytes'
    targets: tuple[tuple[str, str], ...]
    written_for: str
    why: str
    when_absent: str = ""
    kind: BridgeKind = BridgeKind.PATCH
    assigns: tuple[str, ...] = ()
