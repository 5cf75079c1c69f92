"""The language engine: continuous batching over a paged KV cache.

request.py    Request, its status and sampling parameters
scheduler.py  which requests run this step, and how many tokens each
kv_cache.py   the paged KV cache and its block manager
attention.py  attention backends (torch; FlashInfer on GPU)
model.py      the Qwen2 / Qwen2.5-VL language model
runner.py     one batched forward: inputs, positions, image embeddings
sampler.py    greedy / temperature / top-k / top-p, per-request seeds
detokenizer.py  incremental text that never splits a UTF-8 character
engine.py     the loop: schedule() -> run() -> postprocess()
"""
