"""Read GGUF MoE models, index their experts' byte ranges, and write synthetic MoE models."""
