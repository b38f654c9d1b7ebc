"""accelerate 1.15 config YAML (`accelerate config`, `accelerate launch --config_file`) -> RunSpec fields: the
ranks, FSDP's settings and the mixed precision. Defaults: accelerate/commands/launch.py and
accelerate/utils/dataclasses.py `FullyShardedDataParallelPlugin`, as recorded in
docs/research/issue-41-config-sources.md section 4."""

from __future__ import annotations

from .base import Reading

HARMLESS = frozenset({
    "compute_environment", "debug", "machine_rank", "main_training_function", "num_machines", "rdzv_backend",
    "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu", "downcast_bf16", "main_process_ip",
    "main_process_port", "gpu_ids", "enable_cpu_affinity", "tpu_name", "tpu_zone", "commands", "command_file",
})
WARNED = {"deepspeed_config": None, "megatron_lm_config": None, "fp8_config": None, "dynamo_config": None,
          "parallelism_config": None, "ipex_config": None}
# FSDP1's sharding strategies (torch.distributed.fsdp.ShardingStrategy) as FSDP2's reshard_after_forward
_RESHARD_OF_STRATEGY = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
# fsdp_config keys that change nothing vramtrace models (loading, saving, the layer class names, FSDP1 options
# that FSDP2 replaces by its defaults)
_FSDP_HARMLESS = frozenset({
    "cpu_ram_efficient_loading", "state_dict_type", "transformer_layer_cls_to_wrap", "sync_module_states",
    "use_orig_params", "backward_prefetch", "forward_prefetch", "min_num_params", "limit_all_gathers",
})


def read(r: Reading) -> None:
    """Read an accelerate config mapping into `r`: `distributed_type` FSDP with `num_processes` N -> fsdp N (and
    its fsdp_config), MULTI_GPU -> ddp N, DEEPSPEED -> a warning naming --zero and --dp; `mixed_precision` bf16/fp16 -> bf16-mixed /
    fp16-mixed (FSDP's MixedPrecisionPolicy over fp32 parameters, `set_mixed_precision` l.2109)."""
    kind = str(r.get("distributed_type", "NO")).upper()
    ranks = int(r.get("num_processes", 1))
    if kind == "FSDP":
        r.set("fsdp", ranks, "distributed_type", "num_processes")
        _read_fsdp_config(r, dict(r.get("fsdp_config") or {}))
    elif kind == "MULTI_GPU" and ranks > 1:
        r.set("ddp", ranks, "distributed_type", "num_processes")
    elif kind == "DEEPSPEED":
        r.warn("distributed_type", f"DeepSpeed's settings in an accelerate config are not read yet: pass --zero "
                                   f"STAGE --dp {ranks} (or --deepspeed FILE, docs/zero.md); the prediction is for "
                                   "one GPU without ZeRO")
    elif kind not in ("NO", "MULTI_GPU"):
        r.warn("distributed_type", f"{kind} is not modelled; the prediction is for one device")
    r.mark("fsdp_config")
    precision = str(r.get("mixed_precision", "no")).lower()
    if precision in ("bf16", "fp16"):
        r.set("precision", f"{precision}-mixed", "mixed_precision")
    elif precision != "no":
        r.warn("mixed_precision", f"{precision} is not modelled; the prediction uses vramtrace's precision")
    r.check_rest(HARMLESS, WARNED, "accelerate")


def _read_fsdp_config(r: Reading, raw: dict) -> None:
    """fsdp_config (keys with their `fsdp_` prefix, commands/config/cluster.py:399-509). `fsdp_version` absent ->
    1 at launch (commands/launch.py:514-516): FSDP1 is read as FSDP2's layout (both keep 1/N of the parameters,
    gradients and optimizer state per rank; FSDP1's flat-parameter buffers differ), with a warning."""
    config = {k.removeprefix("fsdp_"): v for k, v in raw.items()}
    key = {k.removeprefix("fsdp_"): f"fsdp_config.{k}" for k in raw}.get
    version = int(config.get("version", 1))
    r.launch_env["FSDP_VERSION"] = str(version)  # utils/launch.py:304-333
    if version == 1:
        r.warn("fsdp_config", "no fsdp_version: 2, so accelerate launches FSDP1 (launch.py:514), which vramtrace "
                              "reads as FSDP2's layout (same shards; FSDP1's flat-parameter buffers differ)")
    reshard = config.get("reshard_after_forward", config.get("sharding_strategy", True))
    if isinstance(reshard, str) and reshard.upper() not in ("TRUE", "FALSE"):
        strategy = reshard.upper()
        if strategy not in _RESHARD_OF_STRATEGY:
            r.warn("fsdp_config", f"sharding strategy {strategy} is not modelled; read as FULL_SHARD")
        reshard = _RESHARD_OF_STRATEGY.get(strategy, True)
    elif isinstance(reshard, str):
        reshard = reshard.upper() == "TRUE"
    r.set("reshard_after_forward", bool(reshard), key("reshard_after_forward") or key("sharding_strategy")
          or "fsdp_config.fsdp_reshard_after_forward")
    if config.get("offload_params") in (True, "true", "TRUE"):
        r.set("cpu_offload", True, key("offload_params"))
    if config.get("activation_checkpointing") in (True, "true", "TRUE"):
        # accelerate's checkpoint_wrapper on each layer: non-reentrant
        r.set("checkpointing", "layers", key("activation_checkpointing"))
    policy = str(config.get("auto_wrap_policy", "NO_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        r.warn("fsdp_config", f"auto_wrap_policy {policy} is not modelled; read as TRANSFORMER_BASED_WRAP (each "
                              "layer, then the root: --fsdp-plan layers)")
    for key in sorted(set(config) - _FSDP_HARMLESS - {"version", "reshard_after_forward", "sharding_strategy",
                                                       "offload_params", "activation_checkpointing",
                                                       "auto_wrap_policy"}):
        r.warn("fsdp_config", f"fsdp_{key} is not a key vramtrace's accelerate reader knows; if it changes memory, "
                              "the prediction does not include it")
