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

`tensor_parallel(model, mesh)` applies transformers' own tensor parallelism (the model's `base_model_tp_plan`,
resolved as `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` resolves it, applied by
`transformers.distributed.tensor_parallel.apply_tensor_parallelism`): parameters become DTensors sharded by
`distribute_tensor` (torch.chunk rows on the sharded dim), the styles' forward wrappers run
`_c10d_functional` all-reduces and all-gathers, recorded with their outputs. The local computation DTensor runs
below the dispatch mode is the same local computation the plain step runs, on the local shards: the styles hand
the modules local tensors (`use_local_output`). `meshes(spec)` builds the 1-D mesh of `--fsdp N` or `--tp N`, or
the 2-D ("dp", "tp") mesh of `--fsdp M --tp N` (rank r: data-parallel rank r // N, TP rank r % N), with FSDP2
then sharding the TP-local tensors on dim 0.

What a CPU run of transformers' TP loading does that a device run does not: `from_pretrained` leaves each dim-0
shard a view of the memory-mapped checkpoint on the CPU (the whole tensor's file-backed storage); on a GPU the
shard alone is copied to the device. The trace counts the shard (what a device holds).

`wrap_ddp(model)` wraps the model in `DistributedDataParallel` on the same fake process group (every DDP rank runs
the same program).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
from typing import Iterator

import torch

from ..analysis.categories import Category
from ..errors import TraceError, UsageError
from ..spec import Precision, RunSpec
from .op_rules import op_table


def fsdp_op_categories() -> dict[torch._ops.OpOverload, tuple[str, Category]]:
    """What FSDP2's own ops make or write (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), for the
    recorder's `op_categories`: the flat all-gather input and output (`foreach_all_gather`), the per-parameter
    unsharded storages the output is copied into (`foreach_all_gather_copy_out`), the flat reduce-scatter input
    (`foreach_reduce`), and the temporaries the CPU target's collectives hold (probe.GLOO_TEMPORARY); the
    reduce-scatter output becomes the sharded gradients (views of it), categorised as gradients.

    Op overload -> ('outputs', a keyword argument or 'workspace', category). Built per call, after importing
    `torch.distributed.fsdp`: the `fsdp::` ops are defined (torch.library) when that module loads, so the table
    cannot be built when this module is. Raises OpRuleError (op_rules.py) naming an op this torch lacks."""
    import torch.distributed.fsdp  # noqa: F401  (defines the fsdp:: ops)

    return op_table("FSDP_OP_CATEGORIES", {
        "fsdp.all_gather_copy_in.default": ("outputs", Category.COLLECTIVE_BUFFERS),
        "fsdp.split_with_sizes_copy.default": ("out", Category.UNSHARDED_PARAMETERS),
        "fsdp.chunk_cat.default": ("out", Category.COLLECTIVE_BUFFERS),
        "c10d._allgather_base_.default": ("workspace", Category.COLLECTIVE_BUFFERS),
        "c10d._reduce_scatter_base_.default": ("workspace", Category.COLLECTIVE_BUFFERS),
    })


@contextlib.contextmanager
def fake_rank(world: int, rank: int) -> Iterator[None]:
    """The default process group of the fake backend as rank `rank` of `world`, destroyed on exit. Raises
    TraceError when a process group is already initialized (the caller's own: it is left alone)."""
    import torch.distributed as dist

    from .. import bridges, feature_bridges

    if dist.is_initialized():
        raise TraceError("a torch.distributed process group is already initialized in this process; a sharded "
                         "trace starts its own fake one: call vramtrace outside the distributed job")
    bridges.resolve(bridges.DTENSOR_PLAN_CACHES)  # emptied on exit: checked before the group is made
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's caches of sharding decisions and redistribution plans compare meshes by layout, not by process
        # group: an entry made on the destroyed fake group would hand a later trace that group's name
        feature_bridges.clear_dtensor_caches()


def mixed_precision_policy(precision: Precision):
    """FSDP2's MixedPrecisionPolicy for a mixed precision (parameters all-gathered in bf16/fp16, gradients
    reduce-scattered in fp32, torchtitan's default `mixed_precision_param = bfloat16`, `mixed_precision_reduce =
    float32`); None for a pure precision (the parameters' own dtype throughout). With the policy the step runs
    without autocast: FSDP2 casts the parameters (torchtitan `maybe_enable_amp`: no autocast under FSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    low = {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}.get(precision)
    return None if low is None else MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def meshes(spec: RunSpec):
    """(the FSDP2 mesh or None, the TP mesh or None) of `spec`'s ranks on the meta device, inside `fake_rank`: one
    1-D mesh of `spec.fsdp` or `spec.tp` ranks, or the two dimensions of a ("dp", "tp") mesh of fsdp × tp ranks
    (TP innermost, as transformers/distributed/utils.py `initialize_distributed_mesh` and torchtitan's
    `ParallelDims` lay them out). One TP rank is no TP."""
    from torch.distributed.device_mesh import DeviceMesh

    if spec.tp == 1:  # transformers applies no plan to one TP rank (`prepare_distribute_model`)
        return (DeviceMesh("meta", torch.arange(spec.fsdp)) if spec.fsdp is not None else None), None
    if spec.fsdp is not None and spec.tp is not None:
        mesh = DeviceMesh("meta", torch.arange(spec.fsdp * spec.tp).reshape(spec.fsdp, spec.tp),
                          mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    mesh = DeviceMesh("meta", torch.arange(spec.fsdp or spec.tp))
    return (mesh, None) if spec.fsdp is not None else (None, mesh)


def tp_plan(model: torch.nn.Module, tp: int) -> dict[str, str]:
    """The model's tensor-parallel plan for `tp` ranks, as `from_pretrained(distributed_config=DistributedConfig(
    tp_size=tp))` resolves it (transformers/modeling_utils.py `PreTrainedModel._resolve_parallel_plans`: the
    config's `base_model_tp_plan` prefixed, plus the head's `_tp_plan`). Raises UsageError for a model without
    one."""
    from transformers.distributed import DistributedConfig

    resolve = getattr(model, "_resolve_parallel_plans", None)
    try:
        plan = resolve(DistributedConfig(tp_size=tp))[0] if resolve is not None else None
    except ValueError:  # transformers/distributed/mixin.py: "`tp_size=N` was requested, but ... has no `tp_plan`"
        plan = None
    if not plan:
        name = type(model).__name__
        raise UsageError(f"--tp: {name} has no tensor-parallel plan in transformers (config.base_model_tp_plan); "
                         "use --fsdp N")
    return plan


def tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """transformers' `apply_tensor_parallelism(model, mesh, tp_plan(model, mesh.size()))` on the meta device, inside
    `fake_rank`. Raises UsageError for a model without a plan."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from .. import feature_bridges

    plan = tp_plan(model, mesh.size())
    with feature_bridges.fsdp_on_meta():
        apply_tensor_parallelism(model, mesh, plan)


def shard(model: torch.nn.Module, layers: torch.nn.ModuleList | None, spec: RunSpec, precision: Precision,
          mesh=None) -> None:
    """`fully_shard` each module of `layers`, then `model`, on `mesh` (default: a meta DeviceMesh of `spec.fsdp`
    ranks), with `reshard_after_forward=spec.reshard_after_forward`, `mixed_precision_policy(precision)` and, with
    `spec.cpu_offload`, `CPUOffloadPolicy()`. Call inside `fake_rank`. Raises TraceError when the model has no layer
    stack to shard."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .. import feature_bridges

    if layers is None:
        raise TraceError("--fsdp shards each layer of the model's layer stack, and this model has none that "
                         "vramtrace recognises")
    mesh = mesh if mesh is not None else DeviceMesh("meta", torch.arange(spec.fsdp))
    kwargs = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    policy = mixed_precision_policy(precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    if spec.cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    with feature_bridges.fsdp_on_meta():
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)


def distribute_as_transformers(model: torch.nn.Module, spec: RunSpec, precision: Precision) -> None:
    """transformers' own distribution of `model` (`--fsdp-plan transformers`): what `from_pretrained(...,
    distributed_config=DistributedConfig(tp_size=N, fsdp_size=M, fsdp_mixed_precision=<bf16-mixed>))` runs
    before loading the weights (transformers/distributed/mixin.py `maybe_distribute_model`: the TP plan, then the
    model's FSDP plan by `apply_fully_sharded_data_parallelism`), on its (pp, dp_replicate, fsdp, tp) mesh and the
    experts' (pp, dp_replicate, efsdp, ep) mesh (`initialize_distributed_mesh`) built on the meta device. Inside
    `fake_rank(spec.world, rank)`. Raises UsageError for fp16-mixed (transformers' flag casts to bf16 only) and for
    a model without the plans."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    from .. import feature_bridges

    if precision is Precision.FP16_MIXED:
        raise UsageError("--fsdp-plan transformers casts with fsdp_mixed_precision, bf16 only; use bf16-mixed or "
                         "--fsdp-plan layers")
    fsdp, tp = spec.fsdp, spec.tp or 1
    config = DistributedConfig(fsdp_size=fsdp, tp_size=tp, fsdp_mixed_precision=precision is Precision.BF16_MIXED)
    ranks = torch.arange(fsdp * tp)
    dense = DeviceMesh("meta", ranks.reshape(1, 1, fsdp, tp), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    experts = DeviceMesh("meta", ranks.reshape(1, 1, fsdp * tp, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp",
                                                                                        "ep"))
    try:
        with feature_bridges.fsdp_on_meta():
            type(model).maybe_distribute_model(model, config, TransformersDeviceMesh(dense, experts))
    except ValueError as e:  # a plan the model lacks (transformers/distributed/mixin.py `_resolve_parallel_plans`)
        raise UsageError(f"--fsdp-plan transformers: {str(e).splitlines()[0]}") from None


def parallelize(model: torch.nn.Module, spec: RunSpec, precision: Precision) -> torch.nn.Module:
    """A deep copy of `model` with `spec`'s parallelism applied (TP first, then FSDP2, as torchtitan's
    `parallelize_llama` orders them; `--fsdp-plan transformers`: `distribute_as_transformers`), inside
    `fake_rank(spec.world, rank)`; its layer stack is `layer_stack` of the copy."""
    from ..spec import FsdpPlan
    from .building import layer_stack

    model = copy.deepcopy(model)  # fully_shard and the TP styles change modules and parameters in place
    if spec.fsdp is not None and spec.fsdp_plan is FsdpPlan.TRANSFORMERS:
        distribute_as_transformers(model, spec, precision)
        return model
    dp_mesh, tp_mesh = meshes(spec)
    if tp_mesh is not None:
        tensor_parallel(model, tp_mesh)
    if dp_mesh is not None:
        shard(model, layer_stack(model), spec, precision, dp_mesh)  # checkpointing after: transformers' is by attribute
    return model


_LAYER_INDEX = re.compile(r"\.\d+\.")


def tp_layout(model: torch.nn.Module, spec: RunSpec) -> dict[str, int | None]:
    """Each parameter's TP-sharded dim (None: replicated), by name with layer indices as '*'. Applies the plan to a
    copy on rank 0 of a fake group of `spec.tp` ranks; {} without TP."""
    if spec.tp is None or spec.tp == 1:
        return {}
    from torch.distributed.device_mesh import DeviceMesh

    with fake_rank(spec.tp, 0):
        copied = copy.deepcopy(model)
        tensor_parallel(copied, DeviceMesh("meta", torch.arange(spec.tp)))
        out = {}
        for n, p in copied.named_parameters():
            dims = [pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()]
            out[_LAYER_INDEX.sub(".*.", n)] = dims[0] % max(p.dim(), 1) if dims else None
    return out


def local_shape(shape: tuple[int, ...], tp_dim: int | None, spec: RunSpec, rank: int,
                padded: bool = False) -> tuple[int, ...]:
    """The shape of a parameter of global `shape` that rank `rank` holds: `spec.tp` torch.chunk rows on its TP dim
    `tp_dim`, then `spec.fsdp` rows on dim 0 of that (FSDP2 shards the TP-local tensor: `_fsdp_param.py`
    `FSDPParam._init_sharded_param`); `padded`: FSDP2's storage, padded to the first rank's rows."""
    out = list(shape or (1,))
    dp, t = divmod(rank, spec.tp or 1)
    if tp_dim is not None:
        out[tp_dim] = _rows(out[tp_dim], spec.tp, t)
    if spec.fsdp is not None:
        out[0] = _rows(out[0], spec.fsdp, 0 if padded else dp)
    return tuple(out)


def param_bytes(model: torch.nn.Module, spec: RunSpec, layout: dict[str, int | None]) -> dict[str, int]:
    """Bytes of each parameter's storage on rank `spec.rank` (0 when None) of `spec`'s ranks (`layout`:
    `tp_layout`)."""
    rank = spec.rank or 0
    return {n: math.prod(local_shape(tuple(p.shape), layout.get(_LAYER_INDEX.sub(".*.", n)), spec, rank, True))
            * p.element_size() for n, p in model.named_parameters()}


def _rows(dim0: int, world: int, rank: int) -> int:
    """Rows of a dim-0 size `dim0` that `torch.chunk` gives `rank` of `world`: ceil(dim0 / world) for the first
    ranks, fewer or none for the last (FSDP2 pads every rank's storage to the first's)."""
    chunk = math.ceil(dim0 / world)
    return max(0, min(chunk, dim0 - rank * chunk))


def rank_classes(model: torch.nn.Module, spec: RunSpec, layout: dict[str, int | None] | None = None,
                 ) -> list[tuple[int, ...]]:
    """The ranks of `spec.world` grouped by what they hold: ranks whose local shards have the same shape for every
    parameter (`local_shape`: torch.chunk on the TP dim, then on dim 0 for FSDP2; ceil(size / N) rows for the first
    ranks, fewer or none for the last) run the same program with the same sizes. `layout`: `tp_layout` (computed
    when None). Each group lists its ranks in order; groups are ordered by their first rank."""
    layout = tp_layout(model, spec) if layout is None else layout
    params = {(tuple(p.shape), layout.get(_LAYER_INDEX.sub(".*.", n))) for n, p in model.named_parameters()}
    groups: dict[tuple, list[int]] = {}
    for r in range(spec.world):
        key = tuple(local_shape(shape, dim, spec, r) for shape, dim in sorted(params, key=repr))
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

    from .. import feature_bridges

    ddp = DistributedDataParallel(model, init_sync=False)
    ddp.register_comm_hook(None, _in_place_all_reduce)
    feature_bridges.ddp_on_meta(ddp)
    return ddp
