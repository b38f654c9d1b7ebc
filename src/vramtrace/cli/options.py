"""The options of `vramtrace MODEL ...` (also of `vramtrace fit` and `vramtrace validate`), one `Annotated` alias
each (typer's documented form), so that the command's signature stays a list of names and defaults."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..gpus import GPU_PRESETS
from ..spec import (DEFAULT_CHOICES, TASK_ALIASES, AttnImplementation, CacheKind, Device, KvDtype, Mode, OptimizerImpl,
                    OptimizerKind, Precision, Recipe, Task)


# RunSpec fields whose option is not `--` and the field's name with dashes (`flag_of`)
FIELD_FLAGS = {"inputs": "--input", "memory_budget_bytes": "--memory-budget", "gpu_memory_bytes": "--gpu-memory",
               "cuda_context_bytes": "--cuda-context", "deepspeed_config": "--deepspeed"}


def flag_of(field: str) -> str:
    """The option that sets RunSpec's `field` (`--batch` for batch): how the CLI words a `SpecError`."""
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def _choices(enum_cls) -> str:
    return "|".join(m.value for m in enum_cls)


ModelArg = Annotated[Optional[list[str]], typer.Argument(help="Hub id, bundled id (e.g. meta-llama/Llama-2-7b), "
    "local dir or config.json, custom module path/model.py:NAME or package.module:NAME; "
    "or saved --json reports to re-render (several: compared); optional with a --from file naming the model",
    show_default=False)]
BatchOpt = Annotated[int, typer.Option("--batch", "-b", help="batch size B of input_ids (B, S)")]
SeqOpt = Annotated[Optional[int], typer.Option("--seq", "-s", help="sequence length S (required for text models); "
    "Whisper-style models: the decoder's tokens; wav2vec2-style models: audio "
    "samples of input_values (B, S), 16,000 per second at 16 kHz")]
InputsOpt = Annotated[list[str], typer.Option(
    "--input", help="custom module input NAME=DTYPE[DIMS][:LO..HI], repeatable; "
    "DIMS: ints, B, S; e.g. x=float32[B,3,224,224], ids=int64[B,S]:0..32000 "
    "(integers without a range: 0..2)")]
ImageSizeOpt = Annotated[Optional[int], typer.Option(
    "--image-size", help="H = W of vision models' pixel_values (B, 3, H, W) "
    "[default: the config's image_size, else 224]; a vision-language "
    "model's images before its processor's resize")]
ImagesOpt = Annotated[Optional[int], typer.Option("--images", help="images per sample of a vision-language model "
    "(Qwen2-VL, Qwen2.5-VL, Gemma-3); --seq counts their image tokens "
    "[default: 1]")]
TaskOpt = Annotated[Optional[str], typer.Option(
    "--task", help=" | ".join(m.value for m in Task) + " (or transformers' names: " + ", ".join(TASK_ALIASES) + "): the head "
    "to build and its labels (default: the config's architectures)")]
ChoicesOpt = Annotated[Optional[int], typer.Option(
    "--choices", help=f"C of a multiple-choice head's input_ids (B, C, S) "
    f"(default: {DEFAULT_CHOICES})")]
AttnImplementationOpt = Annotated[Optional[str], typer.Option(
    "--attn-implementation", help=" | ".join(m.value for m in AttnImplementation) + ": transformers' attn_implementation= "
    "(default: the config's, else sdpa where the model has it); flash_attention_2 on a CUDA target is traced "
    "with flash-attn 2.8.3's allocations (no package needed); flex_attention cannot be traced and is refused")]
ModeOpt = Annotated[str, typer.Option("--mode", help=_choices(Mode))]
PrecisionOpt = Annotated[Optional[str], typer.Option(
    "--precision", help=_choices(Precision) + " (*-autocast: the weights in that dtype, the step under autocast, "
    "HF Trainer's bf16/fp16=True on a model loaded in it) [default: bf16-mixed to train, bf16 for inference, "
    "bf16-autocast with --recipe]")]
OptimizerOpt = Annotated[str, typer.Option(
    "--optimizer", help=_choices(OptimizerKind) + " (adafactor: transformers' Adafactor as HF "
    "Trainer builds it); also HF Trainer's optim names: adamw_torch, adamw_torch_fused, ...")]
OptimizerImplOpt = Annotated[str, typer.Option(
    "--optimizer-impl", help=_choices(OptimizerImpl) + " (default: foreach on CUDA, for-loop on "
    "CPU, as torch picks; fused: Adam, AdamW, SGD, Adagrad)")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", help=_choices(Device) + ": the target whose kernels and allocator are modelled")]
GpuOpt = Annotated[str, typer.Option(
    "--gpu", help="target GPU preset: " + ", ".join(p.name for p in GPU_PRESETS.values())
    + " (usable totals as torch.cuda.mem_get_info reports them)")]
CudaContextOpt = Annotated[Optional[str], typer.Option("--cuda-context", help="the CUDA context's memory outside "
    "PyTorch's allocator, e.g. 600MiB (nvidia-smi used minus "
    "torch.cuda.memory_reserved()) [default: by GPU family and "
    "--cuda-version, 769MiB on an H100 with CUDA 13]")]
CudaVersionOpt = Annotated[Optional[int], typer.Option("--cuda-version", help="12 | 13: the CUDA major version of "
    "the target's torch build, for the default CUDA context [default: 13, "
    "torch 2.13's PyPI wheel; 12 below sm75]")]
AllocConfOpt = Annotated[str, typer.Option("--alloc-conf", help="PYTORCH_CUDA_ALLOC_CONF of the target, e.g. "
    "expandable_segments:True or max_split_size_mb:512")]
CheckpointingOpt = Annotated[Optional[str], typer.Option(
    "--checkpointing", help="none | layers[:reentrant] | every:K (K layers per segment) | nth:N (every N-th layer) | selective"
    "[:OP,OP] | modules:PATTERN (submodules whose name matches the glob) | auto (needs --memory-budget) "
    "[default: none; with --quantization and --lora-rank layers:reentrant, as "
    "prepare_model_for_kbit_training]")]
MemoryBudgetOpt = Annotated[Optional[str], typer.Option(
    "--memory-budget", help="peak budget for auto, e.g. 40GiB, 42GB")]
FreezeOpt = Annotated[list[str], typer.Option(
    "--freeze", help="freeze parameters matching a glob, e.g. 'model.embed_tokens.*' "
    "(repeatable): no gradient, no optimizer state")]
LoraRankOpt = Annotated[Optional[int], typer.Option(
    "--lora-rank", help="add peft LoRA adapters of rank R (base weights frozen)")]
LoraAlphaOpt = Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha [default: peft's]")]
LoraDropoutOpt = Annotated[Optional[float], typer.Option("--lora-dropout", help="peft's lora_dropout, e.g. 0.05 (a "
    "dropout of each adapter's input) [default: peft's, 0]")]
LoraTargetsOpt = Annotated[Optional[str], typer.Option("--lora-targets", help="LoRA target modules, e.g. q_proj,v_proj "
    "[default: peft's for the architecture]")]
QuantizationOpt = Annotated[Optional[str], typer.Option(
    "--quantization", help="nf4 | fp4 | int8: bitsandbytes weights as "
    "transformers' BitsAndBytesConfig(load_in_4bit=True / load_in_8bit="
    "True) loads them (with --lora-rank: QLoRA, "
    "prepare_model_for_kbit_training)")]
DoubleQuantOpt = Annotated[bool, typer.Option("--double-quant", help="--quantization: bnb_4bit_use_double_quant")]
BnbComputeDtypeOpt = Annotated[Optional[str], typer.Option("--bnb-compute-dtype", help="--quantization: bf16 | fp16 | "
    "fp32 (bnb_4bit_compute_dtype; default fp32, as transformers')")]
MoeRoutingOpt = Annotated[str, typer.Option("--moe-routing", help="tokens per MoE expert: balanced (equal share) | "
    "worst (all tokens to the same top-k experts: the largest per-expert batches)")]
LoopOpt = Annotated[str, typer.Option(
    "--loop", help="the training loop around the step: trainer (`loss = model(**batch).loss; "
    "loss.backward()`: the output released before backward; HF Trainer, Lightning) | function (`def "
    "train_step(batch): outputs = model(**batch); outputs.loss.backward(); opt.step(); opt.zero_grad()`: outputs "
    "live until it returns) | script (the tutorials' top-level `for batch in loader: outputs = model(**batch); "
    "...`: the previous outputs live until the next forward returns)")]
StepOpt = Annotated[Optional[str], typer.Option("--step", help="your own step function, path/to/file.py:FUNC, called "
    "as FUNC(model, batch, optimizer) for two steps and traced as written")]
GradAccumOpt = Annotated[int, typer.Option("--grad-accum", help="gradient accumulation: N micro-batches per optimizer "
    "step (loss / N, backward each, one step), as HF Trainer's gradient_accumulation_steps")]
ZeroGradOpt = Annotated[str, typer.Option("--zero-grad", help="none (zero_grad(set_to_none=True), torch >= 2.0) | "
    "zeros (set_to_none=False: gradients stay allocated across steps)")]
ClipGradNormOpt = Annotated[Optional[float], typer.Option("--clip-grad-norm", help="torch.nn.utils.clip_grad_norm_ "
    "with this max norm between backward and the optimizer step")]
UseCacheOpt = Annotated[Optional[str], typer.Option("--use-cache", help="true | false: the config's use_cache (false: "
    "no KV cache in the training forward) [default: the config's]")]
NewTokensOpt = Annotated[Optional[int], typer.Option(
    "--new-tokens", help="--mode generate: N new tokens after the --seq "
    "prompt (model.generate(max_new_tokens=N, min_new_tokens=N, greedy))")]
CacheOpt = Annotated[str, typer.Option("--cache", help="--mode generate: " + _choices(CacheKind) + " (transformers' "
    "DynamicCache grows by torch.cat; StaticCache is preallocated to prompt + new tokens)")]
KvDtypeOpt = Annotated[str, typer.Option("--kv-dtype", help="--mode generate: " + _choices(KvDtype) + " (auto: the "
    "compute dtype; fp8: transformers' QuantizedCache(backend='fp8'), float8_e4m3fn keys "
    "and values, dequantized every decode step)")]
FsdpOpt = Annotated[Optional[int], typer.Option(
    "--fsdp", help="N ranks of PyTorch FSDP2: fully_shard on each layer and "
    "the root, traced on fake ranks; --batch is the per-rank micro-batch")]
ReshardAfterForwardOpt = Annotated[str, typer.Option("--reshard-after-forward", help="--fsdp: true | false "
    "(false keeps each layer's parameters unsharded until its backward, "
    "ZeRO-2 style)")]
CpuOffloadOpt = Annotated[bool, typer.Option("--cpu-offload", help="--fsdp: FSDP2's CPUOffloadPolicy (sharded "
    "parameters, gradients and optimizer state in pinned host memory; the optimizer "
    "steps on the CPU)")]
CompileModelOpt = Annotated[bool, typer.Option("--compile", help="the model is torch.compile(model) (Inductor, default "
    "mode; the optimizer eager): its graphs as Inductor compiles them, beside the "
    "eager step; --device cpu training only")]
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help=_choices(Recipe) + ": build the model as "
    "that framework does (its BitsAndBytesConfig, dtype casts, fp32 trainable parameters, checkpointing default; "
    "precision default bf16-autocast)")]
CompileModeOpt = Annotated[str, typer.Option("--compile-mode", help="--compile: torch.compile's mode, default | "
    "max-autotune-no-cudagraphs (its Inductor options set while the graphs compile)")]
PackingOpt = Annotated[bool, typer.Option("--packing", help="sample packing in training: --batch sequences of --seq "
    "tokens each, position ids restarting per sequence, no attention mask (flash_attention_2: one row of "
    "batch*seq tokens with cu_seq_lens, as axolotl feeds it; sdpa/eager: --batch rows with a block-diagonal mask)")]
FsdpPlanOpt = Annotated[str, typer.Option("--fsdp-plan", help="--fsdp: layers (fully_shard each layer, then the "
    "root: torchtitan, accelerate) | transformers (the model's own FSDP plan, as "
    "DistributedConfig(fsdp_size=N) applies it)")]
DdpOpt = Annotated[Optional[int], typer.Option("--ddp", help="N ranks of PyTorch DistributedDataParallel (its default "
    "gradient buckets), traced on a fake rank; --batch is the per-rank micro-batch")]
TpOpt = Annotated[Optional[int], typer.Option("--tp", help="N ranks of tensor parallelism with the model's own plan "
    "(transformers' base_model_tp_plan); with --fsdp M, a 2-D mesh of M x N ranks")]
RankOpt = Annotated[Optional[int], typer.Option("--rank", help="--fsdp/--tp: trace this rank only [default: every "
    "distinct rank, the largest reported]")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero", help="DeepSpeed ZeRO stage 1 | 2 | 3 on --dp ranks: "
    "DeepSpeed's own engine traced on a fake rank (needs the extra vramtrace[deepspeed]); --batch is "
    "train_micro_batch_size_per_gpu")]
DpOpt = Annotated[Optional[int], typer.Option("--dp", help="--zero: N data-parallel ranks")]
OffloadOptimizerOpt = Annotated[Optional[str], typer.Option("--offload-optimizer", help="--zero: cpu (ZeRO-Offload: "
    "the fp32 master partitions and the optimizer state in pinned host memory, the step on the CPU)")]
OffloadParamOpt = Annotated[Optional[str], typer.Option("--offload-param", help="--zero 3: cpu (the parameter "
    "partitions in host memory)")]
DeepspeedOpt = Annotated[Optional[str], typer.Option("--deepspeed", help="--zero: a ds_config JSON file (its "
    "zero_optimization keys go to DeepSpeed as they are; \"auto\" filled as HF's Trainer fills it; its stage, "
    "offloads, micro-batch, accumulation and bf16/fp16 apply unless given here)")]
StrictOpt = Annotated[bool, typer.Option(
    "--strict", help="an op without a meta kernel is an error, not an unresolved entry")]
ComparePoliciesOpt = Annotated[bool, typer.Option("--compare", help="compare checkpointing none, layers and selective")]
JsonPathOpt = Annotated[Optional[str], typer.Option("--json", help="write the JSON report to PATH, or '-' for stdout")]
HtmlPathOpt = Annotated[Optional[str], typer.Option("--html", help="write the self-contained HTML liveness report to "
    "PATH ('-': stdout)")]
SnapshotPathOpt = Annotated[Optional[str], typer.Option(
    "--snapshot", help="write the predicted timeline as a torch.cuda.memory._snapshot() pickle ('-': "
    "stdout)")]
TraceEventsPathOpt = Annotated[Optional[str], typer.Option(
    "--trace-events", help="write the predicted timeline as Chrome trace events (JSON) for ui.perfetto.dev: "
    "a counter track per category, the ops as slices (one step = 1 us of synthetic time); '-': stdout")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option("--trust-remote-code", help="allow configs that need remote code")]
TraceEveryLayerOpt = Annotated[bool, typer.Option(
    "--trace-every-layer", help="trace all layers instead of 4 and replicating the repeated one (slower)")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no terminal report (with --json)")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="on an error, also print the traceback with its causes "
    "(or set VRAMTRACE_DEBUG=1)")]
GpuMemoryOpt = Annotated[Optional[str], typer.Option(
    "--gpu-memory", help="the device capacity the verdict checks, e.g. "
    "48GiB, for a GPU without a preset [default: the --gpu preset's; "
    "with --device cpu: no verdict (fit needs one)]")]
NoLeversOpt = Annotated[bool, typer.Option("--no-levers", help="when the step does not fit, do not trace the levers "
    "that would make it fit (faster)")]
HeadroomOpt = Annotated[Optional[str], typer.Option("--headroom", help="`vramtrace fit`: keep this share of the "
    "capacity free, e.g. 5% [default: 0%]")]
SweepGridOpt = Annotated[Optional[str], typer.Option("--sweep", help="`vramtrace fit`: the peak over a grid of "
    "batches x sequences, e.g. 1,2,4,8x512,1024,2048")]
FromOpt = Annotated[list[str], typer.Option("--from", help="a training config file whose settings the run takes "
    "(repeatable; a later file wins, options typed here win over files): axolotl or LLaMA-Factory YAML, "
    "TrainingArguments JSON, accelerate config YAML (format read from the content; see docs/sources/)",
    show_default=False)]

# --pp (issue 42): pipeline parallelism, one stage traced per distinct program (tracer/pipelining.py)
PpOpt = Annotated[Optional[int], typer.Option("--pp", help="P stages of torch.distributed.pipelining (manual "
    "PipelineStages: stage 0 the embedding and its layers, the last its layers, norm, head and loss), each stage "
    "traced on a fake rank; --batch is the batch of one schedule.step, split into --micro-batches")]
PpScheduleOpt = Annotated[str, typer.Option("--pp-schedule", help="--pp: gpipe | 1f1b | interleaved-1f1b | "
    "zero-bubble (ScheduleGPipe, Schedule1F1B; ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble with "
    "--virtual-stages per rank)")]
MicroBatchesOpt = Annotated[Optional[int], typer.Option("--micro-batches", help="--pp: M micro-batches of "
    "batch / M rows per step [default: P]")]
VirtualStagesOpt = Annotated[Optional[int], typer.Option("--virtual-stages", help="--pp-schedule interleaved-1f1b "
    "or zero-bubble: "
    "V stages per rank, rank r holding stages r, r + P, ... (P x V stages in all) [default: 2]")]
PpSplitOpt = Annotated[Optional[str], typer.Option("--pp-split", help="--pp: decoder layers per stage, e.g. 3,3,2 "
    "(0 allowed; P x V of them with --virtual-stages) [default: even, the remainder on the earliest stages]")]
StageOpt = Annotated[Optional[int], typer.Option("--stage", help="--pp: trace and report this stage only (under "
    "interleaved-1f1b and zero-bubble: this rank, all its stages) [default: every distinct stage, the largest "
    "reported]")]
