"""The device's memory outside the tensors of the step: cuBLAS workspaces, the CUDA context, the allocator's
configuration. Modelled for torch 2.13 on CUDA builds (the version vramtrace pins); sources in each docstring and in
docs/gpus.md.

Device total (about what nvidia-smi shows for the process) = peak reserved (the caching-allocator model, cuBLAS
workspaces included, since they are allocated through it) + the CUDA context (outside the allocator).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

MiB = 2**20
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize with CUBLAS_WORKSPACE_CONFIG unset:
# 4096 * 8 * 1024 on compute capability major 9, 10 and 12 (Hopper, Blackwell; pytorch#175344, torch >= 2.12),
# else ":4096:2:16:8" = 4096 KiB * 2 + 16 KiB * 8.
CUBLAS_WORKSPACE_32MIB = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B
# The CUDA context, the loaded kernel modules and cuBLAS/cuDNN handles, outside PyTorch's allocator. Published
# figures with lazy module loading (CUDA >= 11.7, torch >= 1.13 default): 274 MiB after one tensor (pytorch#86509),
# "~300MB" (pytorch#107667), "around 400MB" (pytorch#109888); it grows as kernels load. 500 MiB is the default,
# above those; `--cuda-context` sets the figure measured on the user's machine (nvidia-smi used minus
# torch.cuda.memory_reserved()). NCCL's buffers (0.5-1.5 GiB per communicator) are not included.
DEFAULT_CUDA_CONTEXT_BYTES = 500 * MiB
# GEMM ops that take a cuBLAS (or cuBLASLt, which shares its workspace in torch 2.12+) workspace
GEMM_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten.addmv", "aten.mv",
                      "aten._scaled_mm", "aten._addmm_activation"})


def cublas_workspace_bytes(sm: int) -> int:
    """The cuBLAS workspace of one (handle, stream) on a GPU of compute capability `sm` (× 10), in bytes:
    CublasHandlePool.cpp `parseChosenWorkspaceSize` in torch 2.13 with CUBLAS_WORKSPACE_CONFIG unset (32 MiB on
    major 9, 10, 12, else 8,519,680 B).

    It is allocated through the caching allocator (`getNewWorkspace`: CUDACachingAllocator::get()->allocate), so it
    counts in memory_allocated() (pytorch#95668 measured 8,519,680 B after one nn.Linear forward on an A10G), at
    the first GEMM of each (handle, stream), and freed only by torch._C._cuda_clearCublasWorkspaces() or at exit.
    Handles are per thread (DeviceThreadHandlePool), and autograd runs CUDA backward on its own device thread
    (torch/csrc/autograd/engine.cpp), so a training step holds two: the forward's and the backward's. cuBLASLt
    (addmm with a bias) reuses the same workspace in torch 2.12+ (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default
    on CUDA builds), so it adds nothing."""
    return CUBLAS_WORKSPACE_32MIB if sm // 10 in (9, 10, 12) else CUBLAS_WORKSPACE_DEFAULT


def first_gemms(ops, steps) -> dict[str, object]:
    """The first GEMM op each thread runs in the ops at `steps`, by thread: 'forward' (the caller's thread:
    forward, optimizer, a --step function's own code) and 'backward' (autograd's device thread, recompute
    included), in that order."""
    found: dict[str, object] = {}
    for i in steps:
        op = ops[i]
        if op.name.rsplit(".", 1)[0] in GEMM_OPS or op.name in GEMM_OPS:
            found.setdefault("backward" if str(op.phase) == "backward" else "forward", op)
    return {t: found[t] for t in ("forward", "backward") if t in found}


def gemm_threads(ops, steps) -> tuple[str, ...]:
    """The threads that run GEMMs in the ops at `steps` (`first_gemms`), 'forward' before 'backward'."""
    return tuple(first_gemms(ops, steps))


@dataclass(frozen=True, slots=True)
class AllocConf:
    """The PYTORCH_CUDA_ALLOC_CONF options the allocator model follows (c10/cuda/CUDAAllocatorConfig.cpp names):
    `expandable_segments`, `max_split_size` (bytes; max_split_size_mb is in MiB), `garbage_collection_threshold`
    (accepted; it acts only under a per-process memory fraction below 1, which is not modelled, so it changes
    nothing here)."""

    expandable_segments: bool = False
    max_split_size: int | None = None
    garbage_collection_threshold: float | None = None

    @classmethod
    def parse(cls, text: str) -> "AllocConf":
        """Parse 'expandable_segments:True,max_split_size_mb:512'. Raises UsageError naming the bad entry and the
        options that are modelled."""
        out = {}
        for item in filter(None, (t.strip() for t in (text or "").split(","))):
            key, sep, value = (x.strip() for x in item.partition(":"))
            try:
                if not sep:
                    raise ValueError
                if key == "expandable_segments":
                    if value not in ("True", "False"):
                        raise ValueError
                    out["expandable_segments"] = value == "True"
                elif key == "max_split_size_mb":
                    mb = int(value)
                    if mb <= 20:  # CUDAAllocatorConfig: at least kLargeBuffer
                        raise ValueError
                    out["max_split_size"] = mb * MiB
                elif key == "garbage_collection_threshold":
                    t = float(value)
                    if not 0 < t < 1:
                        raise ValueError
                    out["garbage_collection_threshold"] = t
                else:
                    raise UsageError(f"--alloc-conf {key!r} is not modelled; the allocator model follows "
                                     "expandable_segments, max_split_size_mb and garbage_collection_threshold")
            except ValueError:
                raise UsageError(f"bad --alloc-conf entry {item!r}; write e.g. expandable_segments:True, "
                                 "max_split_size_mb:512 (> 20), garbage_collection_threshold:0.8") from None
        return cls(**out)

    def __str__(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts)
