"""The global staging buffer and semaphores of a CUDA reduction, mirrored from PyTorch 2.13's source.

`aten/src/ATen/native/cuda/Reduce.cuh` (torch 2.13.0, the header shipped in the wheel): `gpu_reduce_kernel` launches
one kernel per 32-bit-indexable sub-iterator (`TensorIterator::with_32bit_indexing`); for each it computes a
`ReduceConfig` (`setReduceConfig`), and when the config splits the input across thread blocks
(`should_global_reduce`) it allocates, through the caching allocator, a staging buffer of
`ReduceConfig::global_memory_size` bytes and then `ReduceConfig::semaphore_size` bytes of semaphores, both freed
(reverse order) when the sub-iterator's launch returns. Before the sub-iterators, when the accumulation type cannot
accumulate in the output and the iterator needs splitting, an `AccumulationBuffer` of the output's extent in
`sizeof(arg_t)` is allocated for the whole op (when `sizeof(out_scalar_t) < sizeof(arg_t)`).

The iterator's dimensions are those of `TensorIteratorBase::reorder_dimensions` (reduced dimensions first, then by
ascending input stride) and `coalesce_dimensions` (aten/src/ATen/TensorIterator.cpp); `can_use_32bit_indexing`,
`get_dim_to_split` and `split` come from the same file. Device facts: `cudaDeviceProp::multiProcessorCount` and
`maxThreadsPerMultiProcessor` (`GpuPreset.sm_count`, `GpuPreset.max_threads_per_sm`); the warp is 32 threads.

Torch-free: shapes and strides are tuples of ints; byte counts are ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1
WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA GPUs
MIN_VALUES_PER_THREAD = 16  # setReduceConfig, CUDA (ROCm: 128)
MAX_VALUES_PER_THREAD = 256
SEMAPHORE_BYTES = 4  # sizeof(int) per output block column


@dataclass(frozen=True, slots=True)
class ReduceKernel:
    """The template arguments of one `gpu_reduce_kernel<scalar_t, out_scalar_t, vt0, input_vec_size>` launch, in
    bytes: `arg_bytes` sizeof(arg_t) (the accumulation type: float for half/bfloat16 sums, a (value, index) pair of
    16 B for max/min with indices and argmax, Welford's 16 B for var/std of float), `scalar_bytes` the input's
    element, `out_bytes` the output's; `max_threads` mnt_wrapper's MAX_NUM_THREADS (256 for complex<double>,
    else 512); `can_accumulate_in_output` as `gpu_reduce_kernel` decides it (false for half→half,
    bfloat16→bfloat16 and an arg_t not convertible to the output)."""

    arg_bytes: int
    scalar_bytes: int
    out_bytes: int
    vt0: int = 4
    input_vec_size: int = 0  # 0: vt0 (the template's default)
    max_threads: int = 512
    can_accumulate_in_output: bool = True


@dataclass(frozen=True, slots=True)
class ReduceDevice:
    """`cudaDeviceProp::multiProcessorCount` and `maxThreadsPerMultiProcessor` of the target GPU."""

    sm_count: int
    max_threads_per_sm: int


@dataclass(slots=True)
class Iter:
    """A reduction TensorIterator after reordering and coalescing: `shape` (dimension 0 fastest), per operand the
    strides in bytes (`strides[0]` the output's, 0 on reduced dimensions; `strides[1]` the input's), and the input's
    byte offset from a 512-byte aligned allocation (what `get_output_vec_size` sees of its address)."""

    shape: list[int]
    strides: list[list[int]]
    input_offset: int = 0

    @property
    def num_reduce_dims(self) -> int:
        return sum(1 for s in self.strides[0] if s == 0)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def num_output_elements(self) -> int:
        n = 1
        for size, stride in zip(self.shape, self.strides[0]):
            if stride != 0:
                n *= size
        return n

    def can_use_32bit_indexing(self) -> bool:
        """TensorIteratorBase::can_use_32bit_indexing."""
        if self.numel > INT32_MAX:
            return False
        for strides in self.strides:
            if 1 + sum((n - 1) * s for n, s in zip(self.shape, strides)) > INT32_MAX:
                return False
        return True

    def dim_to_split(self) -> int:
        """TensorIteratorBase::get_dim_to_split: the dimension of largest extent, the last one on a tie."""
        best, dim = -1, -1
        for d in range(len(self.shape) - 1, -1, -1):
            if self.shape[d] == 0:
                continue
            for strides in self.strides:
                extent = (self.shape[d] - 1) * abs(strides[d])
                if extent > best:
                    best, dim = extent, d
        return dim

    def split(self, dim: int) -> tuple[Iter, Iter]:
        """TensorIteratorBase::split: (the first half, floor(n / 2) long, and the rest), keeping the dimensions."""
        first = self.shape[dim] // 2
        a = Iter(list(self.shape), [list(s) for s in self.strides], self.input_offset)
        b = Iter(list(self.shape), [list(s) for s in self.strides], self.input_offset + first * self.strides[1][dim])
        a.shape[dim], b.shape[dim] = first, self.shape[dim] - first
        return a, b


def make_iter(shape: tuple[int, ...], in_strides: tuple[int, ...], out_strides: tuple[int, ...], in_bytes: int,
              out_bytes: int, in_offset_bytes: int = 0) -> Iter:
    """The reduction iterator `TensorIterator::reduce_op(viewed_result, input)` builds: `shape` the input's,
    `in_strides` its strides in elements, `out_strides` the result's strides in elements with 0 on every reduced
    dimension (`review_reduce_result`; a size-1 output dimension broadcast to a larger size is reduced). Mirrors
    `reorder_dimensions` (reduced dimensions first, then ascending strides, ties to the smaller size) and
    `coalesce_dimensions`. A 0-d input gives a 0-d iterator."""
    ndim = len(shape)
    ops = [[s * out_bytes for s in out_strides], [s * in_bytes for s in in_strides]]
    perm = list(range(ndim - 1, -1, -1))

    def should_swap(d0: int, d1: int) -> int:
        for arg, strides in enumerate(ops):
            s0, s1 = strides[d0], strides[d1]
            if arg == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    if ndim > 1:
        for i in range(1, ndim):
            d1 = i
            for d0 in range(i - 1, -1, -1):
                c = should_swap(perm[d0], perm[d1])
                if c > 0:
                    perm[d0], perm[d1] = perm[d1], perm[d0]
                    d1 = d0
                elif c < 0:
                    break
    it = Iter([shape[p] for p in perm], [[s[p] for p in perm] for s in ops], in_offset_bytes)
    _coalesce(it)
    return it


def _coalesce(it: Iter) -> None:
    """TensorIteratorBase::coalesce_dimensions."""
    if len(it.shape) <= 1:
        return
    shape, ops = it.shape, it.strides
    prev = 0
    for d in range(1, len(shape)):
        if shape[prev] == 1 or shape[d] == 1 or all(shape[prev] * s[prev] == s[d] for s in ops):
            if shape[prev] == 1:
                for s in ops:
                    s[prev] = s[d]
            shape[prev] *= shape[d]
        else:
            prev += 1
            if prev != d:
                for s in ops:
                    s[prev] = s[d]
                shape[prev] = shape[d]
    del shape[prev + 1:]
    for s in ops:
        del s[prev + 1:]


def _last_pow2(n: int) -> int:
    """Reduce.cuh last_pow2: the largest power of two <= n (at least 1)."""
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(slots=True)
class ReduceConfig:
    """Reduce.cuh `ReduceConfig` after `setReduceConfig`."""

    element_size_bytes: int
    num_outputs: int
    num_inputs: int
    block_width: int = 1
    block_height: int = 1
    num_threads: int = 1
    step_input: int = 1
    step_output: int = 1
    ctas_per_output: int = 1
    input_mult: list[int] = field(default_factory=lambda: [0, 0, 0])
    output_mult: list[int] = field(default_factory=lambda: [0, 0])
    vectorize_input: bool = False
    output_vec_size: int = 1

    def grid_x(self) -> int:
        return _div_up(self.num_outputs // self.output_vec_size, self.step_output)

    def values_per_thread(self) -> int:
        return _div_up(self.num_inputs, self.step_input)

    @property
    def global_memory_size(self) -> int:
        """ReduceConfig::global_memory_size, bytes (0 without a global reduction)."""
        if self.input_mult[2] == 0:
            return 0
        size = self.element_size_bytes * self.num_outputs * self.ctas_per_output
        if self.input_mult[0] == 0:
            size *= self.block_width * self.output_vec_size
        return size

    @property
    def semaphore_size(self) -> int:
        """ReduceConfig::semaphore_size, bytes (0 without a global reduction)."""
        return SEMAPHORE_BYTES * self.grid_x() if self.input_mult[2] != 0 else 0


def _output_vec_size(it: Iter, scalar_bytes: int) -> int:
    """Reduce.cuh get_output_vec_size: 4, halved until it divides the input's address in elements, the first
    output dimension's size and every other input stride in elements."""
    vec = 4

    def update(n: int) -> None:
        nonlocal vec
        while n % vec != 0:
            vec //= 2

    update(it.input_offset // scalar_bytes)
    out_dim = it.num_reduce_dims
    update(it.shape[out_dim])
    for j, stride in enumerate(it.strides[1]):
        if j != out_dim:
            update(stride // scalar_bytes)
    return vec


def _set_block_dimension(c: ReduceConfig, dim0: int, dim1: int, max_threads: int) -> None:
    max_num_threads = max_threads // c.output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_num_threads else max_num_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_num_threads else max_num_threads
    c.block_width = min(dim0_pow2, WARP_SIZE)
    c.block_height = min(dim1_pow2, max_num_threads // c.block_width)
    c.block_width = min(dim0_pow2, max_num_threads // c.block_height)
    c.num_threads = c.block_width * c.block_height


def _split_input(c: ReduceConfig, parallelism: int) -> int:
    step = c.step_input
    c.step_input *= parallelism
    return step


def _split_output(c: ReduceConfig, parallelism: int) -> int:
    step = c.step_output
    c.step_output *= parallelism
    return step


def reduce_config(it: Iter, kernel: ReduceKernel, device: ReduceDevice) -> ReduceConfig:
    """Reduce.cuh `setReduceConfig<arg_t, scalar_t, vt0, input_vec_size>` for a 32-bit-indexable iterator."""
    num_outputs = it.num_output_elements
    c = ReduceConfig(kernel.arg_bytes, num_outputs, it.numel // num_outputs)
    ndim, nred = len(it.shape), it.num_reduce_dims
    inp = it.strides[1]
    if ndim > 0:
        on_fastest = nred == ndim or inp[0] < inp[nred]
        dim0, dim1 = (c.num_inputs, num_outputs) if on_fastest else (num_outputs, c.num_inputs)
        fastest_stride = inp[0] if on_fastest else inp[nred]
    else:
        on_fastest, fastest_stride, dim0, dim1 = True, kernel.scalar_bytes, 1, 1
    if fastest_stride == kernel.scalar_bytes:
        if on_fastest and dim0 >= 128 and nred == 1:
            c.vectorize_input = True
            dim0 //= kernel.input_vec_size or kernel.vt0
        elif not on_fastest:
            c.output_vec_size = _output_vec_size(it, kernel.scalar_bytes)
            dim0 //= c.output_vec_size
    _set_block_dimension(c, dim0, dim1, kernel.max_threads)
    if ndim == 0 or on_fastest:
        c.input_mult[0] = _split_input(c, c.block_width)
    else:
        c.output_mult[0] = _split_output(c, c.block_width)
    warp_split_threshold = min(c.block_height * 16, MAX_VALUES_PER_THREAD)
    if c.values_per_thread() >= warp_split_threshold:
        c.input_mult[1] = _split_input(c, c.block_height)
    else:
        c.output_mult[1] = _split_output(c, c.block_height)
    target_grid_size = device.sm_count * (device.max_threads_per_sm // c.num_threads)
    grid = c.grid_x()
    if c.input_mult[1] != 0 and c.values_per_thread() >= MAX_VALUES_PER_THREAD and grid <= target_grid_size:
        ctas1 = _div_up(target_grid_size, grid)
        ctas2 = _div_up(c.values_per_thread(), MIN_VALUES_PER_THREAD)
        ctas3 = _div_up(c.values_per_thread(), MAX_VALUES_PER_THREAD)
        c.ctas_per_output = max(min(ctas1, ctas2), ctas3)
        if c.ctas_per_output > 1:
            c.input_mult[2] = _split_input(c, c.ctas_per_output)
    return c


def _sub_iters(it: Iter):
    """TensorIterator::with_32bit_indexing (SplitUntil32Bit): the 32-bit-indexable pieces, in launch order."""
    stack = [it]
    while stack:
        cur = stack.pop()
        if cur.can_use_32bit_indexing():
            yield cur
            continue
        first, rest = cur.split(cur.dim_to_split())
        stack.append(rest)
        stack.append(first)


def reduction_blocks(it: Iter, kernel: ReduceKernel, device: ReduceDevice) -> tuple[int, ...]:
    """The bytes `gpu_reduce_kernel` allocates on `it` beyond the output, as the blocks held together at its
    largest moment, in allocation order: the `AccumulationBuffer` (when the iterator needs 32-bit splitting, the
    kernel cannot accumulate in its output and `sizeof(out) < sizeof(arg_t)`), then the staging buffer and the
    semaphores of the sub-iterator that has the largest pair (each sub-iterator frees its pair before the next
    one's launch). () when the reduction stays within thread blocks. An empty iterator (numel 0) launches nothing."""
    if it.numel == 0:
        return ()
    blocks: list[int] = []
    if not kernel.can_accumulate_in_output and not it.can_use_32bit_indexing() \
            and kernel.out_bytes < kernel.arg_bytes:
        extent = max([kernel.out_bytes] + [n * s for n, s in zip(it.shape, it.strides[0])])
        blocks.append(extent // kernel.out_bytes * kernel.arg_bytes)
    best: tuple[int, int] = (0, 0)
    seen: set = set()
    for sub in _sub_iters(it):
        key = (tuple(sub.shape), sub.input_offset % 64)
        if key in seen:
            continue
        seen.add(key)
        c = reduce_config(sub, kernel, device)
        pair = (c.global_memory_size, c.semaphore_size)
        if sum(pair) > sum(best):
            best = pair
    if best[0]:
        blocks += list(best)
    return tuple(blocks)
