"""What a checkpoint is, read without running it: its spec, weights, tokenizer,
prompts and positions, and the demo checkpoints built locally.

spec.py        ModelSpec: the architecture facts every role needs, read once
checkpoint.py  role-specific weight loading: each role reads only what it needs
tokenizer.py   the tokenizer, the chat template, prompts with media placeholders
processor.py   image preprocessing facts: the HF processor and token counts
video.py       video input: the container's header, frame sampling, decoding
mrope.py       M-RoPE positions (Qwen2-VL's 3-D rotary positions)
demo.py        `epd demo-model`: a small checkpoint built locally, no downloads
"""
