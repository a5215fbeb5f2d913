"""Megatron-core models: the GPT builder, heads, portable CP attention, log-probs, weight maps, checkpoints."""
