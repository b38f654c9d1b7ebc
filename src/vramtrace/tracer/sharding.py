"""PyTorch's own FSDP2 and DDP applied to a meta-device model on one fake rank of N.

`fake_rank(world, rank)` starts torch.distributed's built-in fake backend (`dist.init_process_group("fake")`,
torch/csrc/distributed/c10d/FakeProcessGroup.hpp: every collective returns at once and writes nothing), so one
process runs rank `rank`'s program. `shard(model, layers, spec)` applies `fully_shard` to each layer of the stack
and then to the root, as torchtitan (`torchtitan/models/llama3/infra/parallelize.py` `apply_fsdp`) and HF
accelerate's FSDP2 plugin do, on a DeviceMesh of the meta device (`bridges.FSDP_ON_META` lets FSDP2 run there).
The step then runs FSDP2's own hooks: all-gathers (`fsdp.all_gather_copy_in`, `c10d._allgather_base_`,
`fsdp.split_with_sizes_copy`), the unsharded parameters' storages resized up and down, reduce-scatters
(`fsdp.chunk_cat`, `c10d._reduce_scatter_base_`) and sharded gradients, all recorded like any other op.

FSDP2 shards each parameter with `torch.chunk` on dim 0, padded to ceil(dim0 / N) rows
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py `FSDPParam._init_sharded_param`): every rank's sharded
parameter storage has the padded size, but its local tensor (what the optimizer's states copy) has only its own
rows, so the last ranks can hold less. Ranks are traced one at a time.

`wrap_ddp(model)` wraps the model in `DistributedDataParallel` on the same fake process group (every DDP rank runs
the same program).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from ..analysis.categories import Category
from ..errors import TraceError
from ..spec import Precision, RunSpec


# What FSDP2's own ops make or write (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the flat
# all-gather input and output (`foreach_all_gather`), the per-parameter unsharded storages the output is copied
# into (`foreach_all_gather_copy_out`), the flat reduce-scatter input (`foreach_reduce`), and the temporaries the
# CPU target's collectives hold (kernels.GLOO_TEMPORARY); the reduce-scatter output becomes the sharded gradients
# (views of it), categorised as gradients.
FSDP_OP_CATEGORIES = {
    "fsdp.all_gather_copy_in.default": ("outputs", Category.COLLECTIVE_BUFFERS),
    "fsdp.split_with_sizes_copy.default": ("out", Category.UNSHARDED_PARAMETERS),
    "fsdp.chunk_cat.default": ("out", Category.COLLECTIVE_BUFFERS),
    "c10d._allgather_base_.default": ("workspace", Category.COLLECTIVE_BUFFERS),
    "c10d._reduce_scatter_base_.default": ("workspace", Category.COLLECTIVE_BUFFERS),
}


@contextlib.contextmanager
def fake_rank(world: int, rank: int) -> Iterator[None]:
    """The default process group of the fake backend as rank `rank` of `world`, destroyed on exit. Raises
    TraceError when a process group is already initialized (the caller's own: it is left alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise TraceError("a torch.distributed process group is already initialized in this process; a sharded "
                         "trace starts its own fake one: call vramtrace outside the distributed job")
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mixed_precision_policy(precision: Precision):
    """FSDP2's MixedPrecisionPolicy for a mixed precision (parameters all-gathered in bf16/fp16, gradients
    reduce-scattered in fp32, torchtitan's default `mixed_precision_param = bfloat16`, `mixed_precision_reduce =
    float32`); None for a pure precision (the parameters' own dtype throughout). With the policy the step runs
    without autocast: FSDP2 casts the parameters (torchtitan `maybe_enable_amp`: no autocast under FSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}.get(precision)
    return None if low is None else MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def shard(model: torch.nn.Module, layers: torch.nn.ModuleList | None, spec: RunSpec, precision: Precision) -> None:
    """`fully_shard` each module of `layers`, then `model`, on a meta DeviceMesh of `spec.fsdp` ranks, with
    `reshard_after_forward=spec.reshard_after_forward` and `mixed_precision_policy(precision)`. Call inside
    `fake_rank`. Raises TraceError when the model has no layer stack to shard."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .. import bridges

    if layers is None:
        raise TraceError("--fsdp shards each layer of the model's layer stack, and this model has none that "
                         "vramtrace recognises")
    mesh = DeviceMesh("meta", torch.arange(spec.fsdp))
    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    with bridges.fsdp_on_meta():
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)


def sharded_bytes(param: torch.Tensor, world: int) -> int:
    """Bytes of FSDP2's sharded storage of `param` on any of `world` ranks: ceil(dim0 / world) rows of the
    parameter (`FSDPParam._init_sharded_param` pads every rank's shard to the same size)."""
    shape = tuple(param.shape) or (1,)
    return _rows(shape[0], world, 0) * math.prod(shape[1:]) * param.element_size()


def _rows(dim0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 size `dim0` that `torch.chunk` gives `rank` of `world`: ceil(dim0 / world) for the first
    ranks, fewer or none for the last (FSDP2 pads every rank's storage to the first's)."""
    chunk = math.ceil(dim0 / world)
    return max(0, min(chunk, dim0 - rank * chunk))


def rank_classes(model: torch.nn.Module, world: int) -> list[tuple[int, ...]]:
    """The ranks of `world` grouped by what FSDP2 gives them to hold: ranks whose local shards have the same rows
    for every parameter (`torch.chunk` on dim 0: ceil(dim0 / world) rows for the first ranks, fewer or none for
    the last) run the same program with the same sizes. Each group lists its ranks in order; groups are ordered
    by their first rank."""
    groups: dict[tuple[int, ...], list[int]] = {}
    shapes = {tuple(p.shape) or (1,) for p in model.parameters()}
    for r in range(world):
        key = tuple(_rows(s[0], world, r) for s in sorted(shapes))
        groups.setdefault(key, []).append(r)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


def _in_place_all_reduce(state, bucket):
    """DDP's all-reduce of a gradient bucket, in place (NCCL's and gloo's all-reduce write their input; the fake
    backend's future carries no value): a completed future of the bucket's own buffer."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """`DistributedDataParallel(model)` with its defaults (25 MiB buckets, the first 1 MiB, allocated by the
    reducer when DDP is built: torch/csrc/distributed/c10d/reducer.cpp `initialize_buckets`), inside `fake_rank`.
    Built with `init_sync=False`: the parameter-shape check at construction reads a value meta cannot give and the
    initial broadcast leaves nothing allocated. Its all-reduce is `_in_place_all_reduce`.

    Its bucket rebuild is skipped. At its second forward DDP rebuilds its buckets in the order the gradients became
    ready (torch/nn/parallel/distributed.py `_pre_forward`, `reducer._rebuild_buckets()`), syncing the order from
    rank 0 through a tensor copied to the host, which meta cannot answer. The rebuilt buckets hold the same
    gradients, so the same bytes. What is not traced: the moment the rebuild allocates the new buckets while the
    old ones are alive (before the forward, where the step's memory is lowest: parameters, optimizer state and one
    set of buckets; the end of the backward holds that plus every gradient, as much as a second set of buckets,
    with DDP's default `gradient_as_bucket_view=False`). DDP's runtime statistics for its logger (timers, which
    warn on a device without one) are not collected: they allocate nothing (`bridges.DDP_ON_META`)."""
    from torch.nn.parallel import DistributedDataParallel

    from .. import bridges

    ddp = DistributedDataParallel(model, init_sync=False)
    ddp.register_comm_hook(None, _in_place_all_reduce)
    bridges.ddp_on_meta(ddp)
    return ddp
