"""Integrations with training frameworks: `integrations.transformers` (HF `Trainer`: `VramtraceCallback`, `check`).
Each submodule imports its framework; this package imports none."""
