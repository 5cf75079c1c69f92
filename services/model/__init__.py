"""Model layer: checkpoint spec and loaders, demo checkpoint, image tokens, prompts, M-RoPE."""
