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
# The CUDA context: the driver's state, the loaded kernel modules and the cuBLAS/cuDNN handles, outside PyTorch's
# allocator. It grows as kernels load (lazy module loading, CUDA >= 11.7), so the figure that matters is the one
# after a step has run. Per (compute capability major, CUDA major): `CUDA_CONTEXT_TABLE`, `cuda_context_default`.
# NCCL's buffers (0.5-1.5 GiB per communicator) are not included.
CUDA_MAJORS = (12, 13)
# `pip install torch` (PyPI) gives torch 2.13's CUDA 13.0 build: STABLE_CUDA_VERSIONS is 13.0 at the 2.13 go-live
# (pytorch/test-infra#8261, 2026-07-08), "the PyPI-published wheel (currently 13.0)" (pytorch/pytorch#190355); the
# PyPI default moved 12.8 -> 13.0 with torch 2.11 (pytorch/pytorch#177975, #172663).
DEFAULT_CUDA_MAJOR = 13
# CUDA 13 builds target compute capability 7.5 and later (pytorch/pytorch#172663: Turing 7.5 to Blackwell 12.0), so
# a V100 (sm70) runs torch's CUDA 12.6 wheels (download.pytorch.org/whl/cu126)
CUDA13_MIN_SM = 75


@dataclass(frozen=True, slots=True)
class CudaContext:
    """A CUDA context figure: `nbytes` (int) and where it comes from (`source`, one line)."""

    nbytes: int
    source: str


# The one measured after a training step on a known machine: H100 80GB HBM3 (sm90), driver 580.159.04, torch
# 2.11.0+cu130, cudaMemGetInfo's used minus memory_reserved(): 694.8-806.2 MB (663-769 MiB) across 20 processes,
# 804,061,184 B at the fit boundary (vramtrace issue 39's evidence; tests/fixtures/gpu_evidence/fit_boundary.json).
_MEASURED_SM90_CUDA13 = 769 * MiB
_H100_SOURCE = ("measured after a training step on an H100 (sm90), CUDA 13.0, driver 580, torch 2.11: 663-769 MiB "
                "across 20 processes (the largest taken)")
# Published figures for the other families are bare contexts (no step run, few kernels loaded), all below it:
# 426 MiB after mem_get_info on an RTX 6000 Ada (sm89) with torch 2.10.0+cu130 (unslothai/unsloth-zoo#1053), 256 MiB
# on an RTX 3090 (sm86) with torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413), 274 MiB after one tensor (pytorch#86509),
# "~300MB" and "around 400MB" with lazy loading (pytorch#107667, #109888). None after a training step: assumed the
# H100 measurement, the largest known, so that a verdict of "fits" does not rest on a smaller guess.
_ASSUMED = ("assumed: no figure measured after a training step for sm{major}x with CUDA {cuda}; the H100/CUDA 13 "
            "measurement (769 MiB) is taken, above the published bare contexts ({bare})")
_BARE = {7: "none published", 8: "256 MiB RTX 3090 sm86 cu128, 426 MiB RTX 6000 Ada sm89 cu130",
         9: "274-400 MiB, pytorch#86509, #107667, #109888", 10: "none published"}
CUDA_CONTEXT_TABLE: dict[tuple[int, int], CudaContext] = {
    (major, cuda): CudaContext(_MEASURED_SM90_CUDA13, _H100_SOURCE if (major, cuda) == (9, 13) else
                               _ASSUMED.format(major=major, cuda=cuda, bare=_BARE[major]))
    for major in (7, 8, 9, 10) for cuda in CUDA_MAJORS
}
DEFAULT_CUDA_CONTEXT_BYTES = CUDA_CONTEXT_TABLE[(9, DEFAULT_CUDA_MAJOR)].nbytes  # the default target's (H100-80GB)


def default_cuda_major(sm: int) -> int:
    """The CUDA major version of the torch wheel a GPU of compute capability `sm` (× 10) runs by default:
    `DEFAULT_CUDA_MAJOR` (PyPI's torch 2.13), 12 below `CUDA13_MIN_SM` (no CUDA 13 build has its kernels)."""
    return DEFAULT_CUDA_MAJOR if sm >= CUDA13_MIN_SM else 12


def cuda_context_default(sm: int, cuda_major: int) -> CudaContext:
    """The CUDA context assumed for a GPU of compute capability `sm` (× 10, e.g. 90) under CUDA `cuda_major` (12 or
    13): `CUDA_CONTEXT_TABLE` by the capability's major (Blackwell 12.x, sm120, reads the sm10x row). Raises
    UsageError for another CUDA major and for CUDA 13 below sm75 (`CUDA13_MIN_SM`)."""
    if cuda_major not in CUDA_MAJORS:
        raise UsageError(f"--cuda-version must be one of {', '.join(map(str, CUDA_MAJORS))}, got {cuda_major!r}")
    if cuda_major == 13 and sm < CUDA13_MIN_SM:
        raise UsageError(f"CUDA 13 has no kernels for sm{sm} (torch's CUDA 13 wheels start at sm75): use "
                         "--cuda-version 12")
    return CUDA_CONTEXT_TABLE[(min(max(sm // 10, 7), 10), cuda_major)]


# GEMM ops that take a cuBLAS workspace. Recorded op names without the overload (analysis/ is torch-free by design,
# so these sets stay strings; tests/test_op_rules.py checks that each names an aten op)
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
    has a workspace of its own (`cublaslt_workspace_bytes`)."""
    return CUBLAS_WORKSPACE_32MIB if sm // 10 in (9, 10, 12) else CUBLAS_WORKSPACE_DEFAULT


CUBLASLT_WORKSPACE_KIB = 1024  # CublasHandlePool.cpp `parseCUDABlasLtWorkspaceSize`: CUBLASLT_WORKSPACE_SIZE unset
# cuBLASLt's addmm with a bias (aten/src/ATen/native/cuda/Blas.cpp `isInputCompliesAddmmCudaLt`)
LT_GEMM_OPS = frozenset({"aten.addmm", "aten._addmm_activation"})
LT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


def cublaslt_workspace_bytes(sm: int) -> int:
    """The cuBLASLt workspace of one (handle, stream), in bytes: CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB, no
    more than the cuBLAS workspace (CublasHandlePool.cpp `getCUDABlasLtWorkspaceSize`). `getCUDABlasLtWorkspace`
    allocates it through the caching allocator on the first cuBLASLt GEMM of each (handle, stream) unless
    TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 (it then lends the cuBLAS workspace), and clearCublasWorkspaces frees it
    with the others. The H100 of issue 39 (torch 2.11) measured it: 1,048,576 B allocated by MHANet's first
    Linear with a bias, freed by `_cuda_clearCublasWorkspaces()` (benchmarks/gpu_check.py --snapshot)."""
    return min(CUBLASLT_WORKSPACE_KIB * 1024, cublas_workspace_bytes(sm))


def first_lt_gemms(ops, steps, rows: dict) -> dict[str, object]:
    """The first cuBLASLt GEMM each thread runs in the ops at `steps` (by thread, as `first_gemms`): an addmm whose
    first argument is a 1-D bias (a storage of `rows`, sid -> StorageInfo, with one dimension) of a dtype cuBLASLt
    takes (Blas.cpp `isInputCompliesAddmmCudaLt`: beta 1, 1-D bias, float/half/bf16/double; F.linear and
    transformers' Conv1D call it so)."""
    def lt(op) -> bool:
        bias = rows.get(op.reads[0]) if op.name.rsplit(".", 1)[0] in LT_GEMM_OPS and op.reads else None
        return bias is not None and len(bias.shape) == 1 and bias.dtype in LT_DTYPES
    return _first_per_thread(ops, steps, lt)


def first_gemms(ops, steps) -> dict[str, object]:
    """The first GEMM op each thread runs in the ops at `steps`, by thread: 'forward' (the caller's thread:
    forward, optimizer, a --step function's own code) and 'backward' (autograd's device thread, recompute
    included), in that order."""
    return _first_per_thread(ops, steps, lambda op: op.name.rsplit(".", 1)[0] in GEMM_OPS or op.name in GEMM_OPS)


def _first_per_thread(ops, steps, wanted) -> dict[str, object]:
    """The first op of `steps` with `wanted(op)` per thread ('forward', then 'backward': see `first_gemms`)."""
    found: dict[str, object] = {}
    for i in steps:
        op = ops[i]
        if wanted(op):
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
