"""Everything that touches torch: loading configs, building the model on meta, tracing the step."""
