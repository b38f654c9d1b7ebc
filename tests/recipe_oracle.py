"""Ground truth for `--recipe`: the model built for real on the CPU the way axolotl 0.21.0 and LLaMA-Factory 0.9.5
build it, written literally from their source (docs/research/issue-41-config-sources.md 1.2, 2.1, 2.3), with
public transformers / peft / bitsandbytes APIs only, then measured as tests/oracle.py measures a step. Like
tests/oracle.py it imports nothing from vramtrace; neither framework is installed (axolotl 0.21 needs Python >=
3.12, LLaMA-Factory 0.9.5 pins transformers <= 5.6), so their steps are written out here with the source each
mirrors.

- `axolotl_qlora_step`: a tiny checkpoint saved in bf16, loaded with `from_pretrained(dir, dtype=bf16,
  quantization_config=BitsAndBytesConfig(...))` exactly as `_set_quantization_config` builds it, config.use_cache
  False (`loaders/utils.py check_model_config`); `_configure_embedding_dtypes`: "norm" modules to fp32, checkpointing
  enabled with the config's kwargs, axolotl's patched `prepare_model_for_kbit_training` (peft's own source with
  axolotl's `PATCHED_PREPARE_CODE` substituted, `monkeypatch/peft/utils.py`, compiled into a new function here;
  peft itself is not patched), the "norm" and embedding modules back to bf16; `get_peft_model` with axolotl's
  LoraConfig; HF Trainer's re-enabling of checkpointing with the TrainingArguments kwargs; the Trainer's step:
  forward and loss under `torch.autocast("cpu", bf16)`, backward, `clip_grad_norm_(max_grad_norm=1.0)`, the
  optimizer step, `zero_grad(set_to_none=True)`.
- `llamafactory_qlora_step`: config.use_cache False (`configure_kv_cache`), `from_pretrained(dir, config=config,
  torch_dtype="auto", quantization_config=BitsAndBytesConfig(...))` as `configure_quantization` builds it;
  `prepare_model_for_training`'s checkpointing (`_gradient_checkpointing_enable` with
  `get_custom_gradient_checkpointing_func`, use_reentrant True); `init_adapter`'s `get_peft_model` and fp32
  trainable parameters; the same Trainer step (TrainingArguments' gradient_checkpointing stays False).
"""

from __future__ import annotations

import functools
import inspect
import tempfile
import warnings

import torch
import transformers

from oracle import RealStep, _measure_step, hf_batch, hf_config, hf_model, make_optimizer

# axolotl monkeypatch/peft/utils.py: the loop of peft's prepare_model_for_kbit_training, and axolotl's replacement
_PEFT_CAST_LOOP = """
        for param in model.parameters():
            if (
                (param.dtype == torch.float16) or (param.dtype == torch.bfloat16)
            ) and param.__class__.__name__ != "Params4bit":
                param.data = param.data.to(torch.float32)
"""
_AXOLOTL_CAST_LOOP = """
        for name, param in model.named_parameters():
            if (
                (param.dtype == torch.float16) or (param.dtype == torch.bfloat16)
            ) and param.__class__.__name__ != "Params4bit" and all(embed_name not in name for embed_name in {names}):
                param.data = param.data.to(torch.float32)
"""
EMBEDDINGS = ["embed_tokens", "lm_head"]  # axolotl loaders/utils.py get_linear_embedding_layers("llama")


def _axolotl_prepare_for_kbit():
    """peft's `prepare_model_for_kbit_training` with axolotl's patched cast loop (`patch_peft_prep_code`), as a
    new function in peft.utils.other's namespace."""
    import peft.utils.other as other

    source = inspect.getsource(other.prepare_model_for_kbit_training)
    lines = source.splitlines(keepends=True)
    indent = len(lines[0]) - len(lines[0].lstrip())
    source = "".join(line[indent:] for line in lines)
    assert _PEFT_CAST_LOOP in source, "peft's cast loop changed: axolotl's patch would not apply"
    source = source.replace(_PEFT_CAST_LOOP, _AXOLOTL_CAST_LOOP.format(names=EMBEDDINGS))
    namespace = dict(vars(other))
    exec(compile(source, "<axolotl patch_peft_prep_code>", "exec"), namespace)
    return namespace["prepare_model_for_kbit_training"]


def _saved_bf16(config, directory: str) -> None:
    """A tiny checkpoint: random weights (seed 0) saved in bf16, as the Hub's bf16 checkpoints are."""
    hf_model(config, torch.bfloat16).save_pretrained(directory)


def _convert(model, embeddings: list[str], dtype: torch.dtype, before: bool) -> None:
    """axolotl loaders/model.py `_convert_embedding_modules_dtype` (no fp32_norms, not btlm, lora_on_cpu unset)."""
    for name, module in model.named_modules():
        if "norm" in name:
            module.to(dtype)
        if before and name.endswith(".gate"):
            module.to(dtype)
        if any(m in name for m in embeddings) and hasattr(module, "weight"):
            module.to(dtype)


def _axolotl_model(case: dict, directory: str):
    """axolotl's ModelLoader for a QLoRA (`quantization`), LoRA (`lora_rank`) or full fine-tune run, with
    `gradient_checkpointing` (the case's `checkpointing`, default True)."""
    import peft

    config = hf_config(case["model"])
    config.use_cache = False  # check_model_config
    _saved_bf16(config, directory)
    quantized, adapter, gc = case.get("quantization"), case.get("lora_rank"), case.get("checkpointing", True)
    kw = {}
    if quantized:  # _set_quantization_config (llama: no skip modules, bf16 storage)
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, llm_int8_threshold=6.0, llm_int8_has_fp16_weight=False,
            bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_quant_storage=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, config=config, dtype=torch.bfloat16, attn_implementation="sdpa", device_map="cpu", **kw)
    kwargs = {"use_reentrant": False}  # normalize_config: no ZeRO-3 -> use_reentrant False
    should_convert = bool(adapter)  # should_convert_embedding_dtypes: an adapter run (sdpa needs no dtype cast)
    _convert(model, [] if should_convert else EMBEDDINGS, torch.float32, before=True)
    if adapter and gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if adapter and quantized:  # _prepare_model_for_quantization
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _axolotl_prepare_for_kbit()(model, use_gradient_checkpointing=gc)
    if should_convert:
        _convert(model, EMBEDDINGS, torch.bfloat16, before=False)
    if adapter:
        lora = peft.LoraConfig(r=adapter, lora_alpha=case["lora_alpha"], target_modules=case["lora_targets"],
                               lora_dropout=case["lora_dropout"], bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, lora)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # Trainer.train, TrainingArguments'
    return model, config


def _custom_checkpointing_func(checkpoint_func):
    """LLaMA-Factory model_utils/checkpointing.py `get_custom_gradient_checkpointing_func`: only modules with
    trainable parameters are checkpointed, their first float input made to require grad. The module is
    `func.func.__self__` there (transformers <= 5.6 passes `partial(super().__call__, **kwargs)`); transformers 5.24's
    GradientCheckpointingLayer passes `partial(forward, self, **kwargs)`, the module being its first argument."""
    @functools.wraps(checkpoint_func)
    def run(func, *args, **kwargs):
        module = getattr(func.func, "__self__", None) or func.args[0]
        if any(p.requires_grad for p in module.parameters()):
            for arg in args:
                if torch.is_tensor(arg) and torch.is_floating_point(arg):
                    arg.requires_grad_(True)
                    break
            return checkpoint_func(func, *args, **kwargs)
        return func(*args, **kwargs)
    return run


def _llamafactory_model(case: dict, directory: str):
    """LLaMA-Factory's load_model + init_adapter for a QLoRA (`quantization`), LoRA (`lora_rank`) or full
    fine-tune run, its default checkpointing on."""
    import peft

    config = hf_config(case["model"])
    _saved_bf16(config, directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    config.use_cache = False  # configure_kv_cache (trainable)
    kw = {}
    if case.get("quantization"):  # configure_quantization, on-the-fly bnb, compute_dtype bf16
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True,
            bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, config=config, torch_dtype="auto",
                                                              device_map={"": "cpu"}, **kw)
    # prepare_model_for_training -> _gradient_checkpointing_enable({"use_reentrant": True}), new GC format
    func = _custom_checkpointing_func(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    model.config.use_cache = False
    if case.get("lora_rank"):
        lora = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, inference_mode=False, r=case["lora_rank"],
                               target_modules=case["lora_targets"], lora_alpha=case["lora_alpha"],
                               lora_dropout=case["lora_dropout"], use_rslora=False, use_dora=False,
                               modules_to_save=None)
        model = peft.get_peft_model(model, lora)
    for p in model.parameters():  # init_adapter: cast_trainable_params_to_fp32 (_setup_full_tuning: all)
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
    return model, config


def _trainer_step(model, config, case: dict) -> RealStep:
    """HF Trainer's step on `model`: bf16 autocast (TrainingArguments bf16=True), clip_grad_norm_ at
    max_grad_norm 1.0, the case's optimizer over the trainable parameters, zero_grad(set_to_none=True); the
    case's `grad_accum` micro-batches per optimizer step (default 1), the literal loop of tests/oracle.py."""
    step = RealStep.__new__(RealStep)
    step.train, step.compiled, step.generate = True, False, None
    step.quantized = bool(case.get("quantization"))
    step.autocast = torch.bfloat16
    step.args, step.loss_of = (), (lambda out: out.loss)
    step.kwargs = hf_batch(model, config, case["batch"], case["seq"], True, None, torch.bfloat16)
    model.train(True)
    step.model = model
    step.opt = make_optimizer(case["optimizer"], case.get("optimizer_impl", "default"),
                              [p for p in model.parameters() if p.requires_grad])
    step.loop, step.n, step.zero_grad, step.clip = "trainer", case.get("grad_accum", 1), "none", 1.0
    step.scaler, step.script_vars, step.user_step = None, {}, None
    return step


def measure_recipe_peak(recipe: str, case: dict) -> int:
    """Peak bytes of the steady-state step of `case` (model, batch, seq, optimizer[, optimizer_impl]; quantization
    for 4-bit nf4; lora_rank, lora_alpha, lora_dropout, lora_targets for LoRA; checkpointing, axolotl's
    gradient_checkpointing, default True) built as `recipe` ('axolotl' or 'llamafactory') builds it, measured as
    tests/oracle.py measures a step."""
    build = {"axolotl": _axolotl_model, "llamafactory": _llamafactory_model}[recipe]
    with tempfile.TemporaryDirectory(prefix=f"oracle-{recipe}-") as directory:
        model, config = build(case, directory)
    return _measure_step(_trainer_step(model, config, case))
