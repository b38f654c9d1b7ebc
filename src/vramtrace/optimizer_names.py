"""The optimizer names `spec.OptimizerKind.parse` takes besides its own: HF Trainer's `optim` names and
bitsandbytes' class names. Data only."""

# HF Trainer's `optim` names (transformers/training_args.py::OptimizerNames) that name a torch or transformers
# optimizer vramtrace builds: name -> (OptimizerKind value, OptimizerImpl value or None). The implementation follows
# transformers/trainer_optimizer.py (`adamw_torch_fused` passes fused=True; the others leave torch's default).
HF_OPTIM_NAMES = {
    "adamw_torch": ("adamw", None), "adamw_torch_fused": ("adamw", "fused"), "adafactor": ("adafactor", None),
    "sgd": ("sgd", None), "adagrad": ("adagrad", None), "rmsprop": ("rmsprop", None),
    "adamw_bnb_8bit": ("adamw-8bit", None), "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("paged-adamw-8bit", None), "paged_adamw_32bit": ("paged-adamw", None),
    "lion_8bit": ("lion-8bit", None), "lion_32bit": ("lion-32bit", None), "paged_lion_32bit": ("paged-lion", None),
    "paged_lion_8bit": ("paged-lion-8bit", None), "rmsprop_bnb": ("rmsprop-bnb", None),
    "rmsprop_bnb_32bit": ("rmsprop-bnb", None), "rmsprop_bnb_8bit": ("rmsprop-bnb-8bit", None),
    "ademamix": ("ademamix", None), "ademamix_8bit": ("ademamix-8bit", None),
    "paged_ademamix_32bit": ("paged-ademamix", None), "paged_ademamix_8bit": ("paged-ademamix-8bit", None),
}
# HF Trainer's `optim` names (transformers 5.24, training_args.py::OptimizerNames) that build an optimizer vramtrace
# does not trace: torchao's low-bit AdamW, XLA's and Ascend NPU's fused AdamW, torchdistx's AnyPrecisionAdamW, GaLore,
# LOMO, GrokAdamW, schedule-free, APOLLO and optimi's StableAdamW. (`adamw_hf` was removed in transformers 5.)
HF_UNTRACED_OPTIM_NAMES = frozenset({
    "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision", "adamw_torch_4bit", "adamw_torch_8bit",
    "galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise", "lomo", "adalomo", "grokadamw", "schedule_free_radam", "schedule_free_adamw",
    "schedule_free_sgd", "apollo_adamw", "apollo_adamw_layerwise", "stable_adamw",
})
# bitsandbytes' optimizer class names (bitsandbytes/optim/*.py), lower-cased, that name an OptimizerKind; the
# plain `AdamW`, `Adam`, `Lion`, `RMSprop` classes are left out: without a bit count they read as torch's optimizers
BNB_CLASS_NAMES = {
    "adam8bit": "adam-8bit", "adamw8bit": "adamw-8bit", "pagedadamw8bit": "paged-adamw-8bit",
    "pagedadamw": "paged-adamw", "pagedadamw32bit": "paged-adamw", "lion8bit": "lion-8bit", "lion32bit": "lion-32bit",
    "pagedlion": "paged-lion", "pagedlion32bit": "paged-lion", "pagedlion8bit": "paged-lion-8bit",
    "rmsprop8bit": "rmsprop-bnb-8bit", "rmsprop32bit": "rmsprop-bnb", "ademamix8bit": "ademamix-8bit",
    "ademamix32bit": "ademamix", "pagedademamix": "paged-ademamix", "pagedademamix32bit": "paged-ademamix",
    "pagedademamix8bit": "paged-ademamix-8bit",
}
