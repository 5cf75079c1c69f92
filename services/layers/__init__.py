"""The compute layer: the networks and the kernels they run on, used by the
language engine and by Triton's vision model alike.

language_model.py  the Qwen2 / Qwen2.5-VL / Qwen3-VL(-MoE) language model
moe.py             MoE experts: fused per layer, FlashInfer's kernel on CUDA
attention.py       attention backends: torch, the compiled CPU kernels, FlashInfer
linear.py          projections on EPD's kernels or oneDNN's packed weights
vision_tower.py    the vision towers Triton serves, with faster modules swapped in
cpu_kernels.py     EPD's C kernels (csrc/): built on first use, loaded with ctypes
cpu_decode.py      a decode step's decoder layers in one compiled call
backends.py        which backend each `auto` choice resolves to on this machine
build.py           the factory the engine calls: its network on those backends
"""
