"""oneDNN's own answer to how large a matmul's scratchpad is, asked without running the matmul.

Where oneDNN's CPU ISA is avx512_core or above (AVX-512 BW/VL/DQ: native AVX-512-BF16 or AMX not needed; ATen's
`mkldnn_bf16_device_check`, ideep's `has_bf16_type_support`; not under `ONEDNN_MAX_CPU_ISA=AVX2`), ATen sends bf16
`mm`, `addmm`, `bmm` and `baddbmm` to oneDNN (aten/src/ATen/native/mkldnn/Matmul.cpp `use_mkldnn_bf16_matmul`, then
`mkldnn_matmul`), through ideep's `matmul_forward`, which creates a matmul primitive descriptor from the tensors'
plain strided memory descriptors with the attribute `scratchpad_mode = user` (ONEDNN_VERBOSE prints
`attr-scratchpad:user`; addmm adds a `sum` post-op, which leaves the scratchpad as it is) and allocates
`pd.scratchpad_desc()`'s bytes through c10's CPU allocator before it executes. That size comes from oneDNN's
blocking heuristics (src/cpu/x64/matmul/brgemm_matmul_utils.cpp: per-thread A, B and accumulator buffers), which
step with the sizes, the thread count and the CPU's caches: not affine in the sizes (Llama-2-7b's (8192, 4096) @
(4096, 4096): 165,504, 198,272 and 263,808 B at 1/32, 1/16 and 1/8 of each dimension, which a line through them
would put at 1,181,312 B; oneDNN books 3,442,432 B at full size).
fp16 matmuls go to oneDNN only with native fp16 (`mkldnn_fp16_device_check`): on an AVX-512 CPU without it
(avx512_core, no avx512_fp16 nor avx512_bf16) a (128, 176) @ (176, 32) mm books 16,512 B in bf16 at two threads,
0 B in fp16, so a trace must run the dtype the real step runs.

`matmul_scratchpad_bytes` asks the oneDNN that this torch carries, through its C API
(`dnnl_matmul_primitive_desc_create`, `dnnl_primitive_desc_query_md(..., dnnl_query_scratchpad_md)`,
`dnnl_memory_desc_get_size`): milliseconds, where running Llama-2-7b's lm_head matmul takes seconds. libtorch_cpu
does not export those functions, so they are found in its ELF symbol table (`.symtab`) and called at the address
the dynamic loader mapped them to. Used only where its answer is checked first: `probe.CpuWorkspaceProbe` takes
it for a large op only when it equals the workspace the profiler measured at each of the op's reduced sizes.
Linux only; None wherever anything is missing (a stripped library, another oneDNN major version, a descriptor
oneDNN refuses), and the probe then measures as before.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
from pathlib import Path

import torch

# oneDNN 3.x C API constants (include/oneapi/dnnl/dnnl_common_types.h, dnnl_types.h of the torch wheel)
_ENGINE_CPU = 1  # dnnl_cpu
_SCRATCHPAD_MODE_USER = 1  # dnnl_scratchpad_mode_user
_QUERY_SCRATCHPAD_MD = 136  # dnnl_query_scratchpad_md (dnnl_query_some_md = 128, then src, diff_src, weights, ...)
_DATA_TYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}  # dnnl_f16, dnnl_bf16, dnnl_f32
_MAJOR = 3

_FUNCTIONS = ("dnnl_version", "dnnl_engine_create", "dnnl_memory_desc_create_with_strides",
              "dnnl_memory_desc_destroy", "dnnl_primitive_attr_create", "dnnl_primitive_attr_destroy",
              "dnnl_primitive_attr_set_scratchpad_mode", "dnnl_matmul_primitive_desc_create",
              "dnnl_primitive_desc_query_md", "dnnl_memory_desc_get_size", "dnnl_primitive_desc_destroy")


class _Version(ctypes.Structure):  # dnnl_version_t
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


def _symbol_addresses(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    """name -> st_value of the FUNC symbols `names` in the ELF64 little-endian `path`'s `.symtab` ({} without one)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            return {}
        (shoff,) = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        found: dict[str, int] = {}
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != 2 or not entsize:  # SHT_SYMTAB
                continue
            strtab = sections[link][4]
            wanted = {}  # offset of the name in the string table -> name
            for name in names:
                at = m.find(b"\0" + name.encode() + b"\0", strtab, strtab + sections[link][5])
                if at >= 0:
                    wanted[at + 1 - strtab] = name
            for st_name, st_info, _other, _shndx, st_value, _size in struct.iter_unpack(
                    "<IBBHQQ", m[offset:offset + size - size % entsize]):
                if st_name in wanted and st_info & 0xF == 2 and st_value:  # STT_FUNC, defined
                    found[wanted[st_name]] = st_value
        return found


def _load_base(path: Path) -> int | None:
    """Where the dynamic loader mapped `path` in this process (its address 0), from /proc/self/maps."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and int(parts[2], 16) == 0 and os.path.realpath(parts[5]) == real:
                    return int(parts[0].split("-")[0], 16)
    except OSError:
        pass
    return None


class _OneDnn:
    """oneDNN's C API in this process's libtorch_cpu, checked against torch's own build information."""

    def __init__(self, path: Path):
        addresses = _symbol_addresses(path, _FUNCTIONS)
        base = _load_base(path)
        if base is None or set(addresses) != set(_FUNCTIONS):
            raise OSError(f"oneDNN's C API not found in {path}")
        p, i, i64p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)

        def fn(name, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)(base + addresses[name])

        version = fn("dnnl_version", ctypes.POINTER(_Version))().contents
        build = torch.__config__.show()
        if version.major != _MAJOR or not version.hash or f"Git Hash {version.hash.decode()}" not in build:
            raise OSError(f"oneDNN {version.major}.{version.minor} at {path} is not the one torch reports")
        self.memory_desc = fn("dnnl_memory_desc_create_with_strides", i, ctypes.POINTER(p), i, i64p, i, i64p)
        self.memory_desc_destroy = fn("dnnl_memory_desc_destroy", i, p)
        self.attr_create = fn("dnnl_primitive_attr_create", i, ctypes.POINTER(p))
        self.attr_destroy = fn("dnnl_primitive_attr_destroy", i, p)
        self.attr_scratchpad_mode = fn("dnnl_primitive_attr_set_scratchpad_mode", i, p, i)
        self.matmul = fn("dnnl_matmul_primitive_desc_create", i, ctypes.POINTER(p), p, p, p, p, p, p)
        self.query_md = fn("dnnl_primitive_desc_query_md", p, p, i, i)
        self.md_size = fn("dnnl_memory_desc_get_size", ctypes.c_size_t, p)
        self.pd_destroy = fn("dnnl_primitive_desc_destroy", i, p)
        self.engine = p()
        if fn("dnnl_engine_create", i, ctypes.POINTER(p), i, ctypes.c_size_t)(
                ctypes.byref(self.engine), _ENGINE_CPU, 0) != 0:
            raise OSError("oneDNN could not create a CPU engine")

    def _md(self, t: torch.Tensor) -> ctypes.c_void_p:
        md, n = ctypes.c_void_p(), t.dim()
        if self.memory_desc(ctypes.byref(md), n, (ctypes.c_int64 * n)(*t.shape), _DATA_TYPES[t.dtype],
                            (ctypes.c_int64 * n)(*t.stride())) != 0:
            raise ValueError("oneDNN refused a memory descriptor")
        return md

    def matmul_scratchpad(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int | None:
        mds, attr, pd = [], ctypes.c_void_p(), ctypes.c_void_p()
        try:
            mds = [self._md(t) for t in (a, b, out)]
            if self.attr_create(ctypes.byref(attr)) != 0 or self.attr_scratchpad_mode(attr, _SCRATCHPAD_MODE_USER):
                return None
            if self.matmul(ctypes.byref(pd), self.engine, mds[0], mds[1], None, mds[2], attr) != 0:
                return None  # no implementation for these descriptors
            md = self.query_md(pd, _QUERY_SCRATCHPAD_MD, 0)
            return int(self.md_size(md)) if md else 0
        except ValueError:
            return None
        finally:
            if pd:
                self.pd_destroy(pd)
            if attr:
                self.attr_destroy(attr)
            for md in mds:
                self.memory_desc_destroy(md)


@functools.cache
def _library() -> _OneDnn | None:
    if not torch.backends.mkldnn.is_available() or not os.path.exists("/proc/self/maps"):
        return None
    try:
        return _OneDnn(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
    except (OSError, ValueError, struct.error, IndexError):
        return None


def matmul_scratchpad_bytes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int | None:
    """Bytes of the user scratchpad oneDNN books for the matmul `out = a @ b` as ideep creates it (tensors of any
    device, meta included: only shapes, strides and dtypes are read; 2-D (M, K) @ (K, N) or batched 3-D), at this
    thread's current thread count (oneDNN reads `omp_get_max_threads()` when it creates the descriptor). None when
    oneDNN's C API cannot be reached here, a dtype is not fp32, bf16 or fp16, or oneDNN has no implementation for
    them. Whether ATen actually sends the op to oneDNN is not decided here: the caller checks
    the answer against measured runs."""
    if not all(isinstance(t, torch.Tensor) and t.dtype in _DATA_TYPES and t.dim() == a.dim() in (2, 3)
               for t in (a, b, out)):
        return None
    library = _library()
    return None if library is None else library.matmul_scratchpad(a, b, out)
