"""The language engine: continuous batching over a paged KV cache.

The loop (one step: `schedule()`, the model runner's forward, then sampling and
outputs; the network and kernels it runs are built by services/layers/build.py):
request.py      Request, its status and sampling parameters
scheduler.py    which requests run this step, and how many tokens each
kv_cache.py     the paged KV cache, its block manager and prefix cache
runner.py       one batched forward: inputs, positions, image embeddings
cuda_graphs.py  decode steps replayed from CUDA graphs (CUDA, FlashInfer)
sampler.py      greedy / temperature / top-k / top-p, per-request seeds
grammar.py      structured output: xgrammar's compiled grammars and token masks
detokenizer.py  incremental text that never splits a UTF-8 character
vision.py       the monolithic baseline's vision tower inside the loop
pacing.py       the threads of a step, and the wait of a decode step, while images encode
config.py       EngineConfig, and the checks a request must pass
outputs.py      what the engine gives back: outputs, step figures, load, errors
engine.py       LLMEngine: the loop, `step()`

Its hosts (how the language service runs it):
loop.py         the loop both hosts run (messages in, a step, replies out)
interface.py    Engine, what the service asks of a host
async_engine.py AsyncEngine: the loop on a thread of this process
process.py      EngineProcess: the loop in a child process of its own
"""
