"""vLLM's engine alone, for bench/peer.py's `--peer-engine-alone`: its offline
`LLM` (no server, no client) on the token ids bench/peer.py wrote, as many at a
time as the client keeps in flight. Run it with vLLM's own Python:

    PEER_VENV/bin/python bench/vllm_engine_alone.py CHECKPOINT PROMPTS.json \\
        OUTPUT_LEN CONCURRENCY [DTYPE]

It sets what ../shared/peers/vllm-cpu.sh sets for the peer's server (Intel
OpenMP preloaded, OpenMP threads bound to this process's CPUs, none reserved,
2 GiB of KV cache) unless the environment says otherwise, and the server's
step budget of 2048 tokens (EPD's engine's too), warms up on the
first CONCURRENCY prompts reversed (not the timed ones: its prefix cache would
skip their prefill), times one pass over all of them, and prints a line
{"output_tok_s": ...}: the same measure as EPD's engine alone
(bench/engine.py's engine_tokens_per_second).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _cpu_ranges() -> str:
    """This process's CPUs as vLLM's VLLM_CPU_OMP_THREADS_BIND takes them ("0-1,4")."""
    ranges: list[list[int]] = []
    for cpu in sorted(os.sched_getaffinity(0)):
        if ranges and ranges[-1][1] == cpu - 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def _with_peer_environment() -> None:
    """Re-executes this script with Intel OpenMP preloaded (as the peer's server
    runs) where vLLM's environment ships it; sets vLLM's CPU settings."""
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and str(iomp) not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = f"{iomp} {os.environ.get('LD_PRELOAD', '')}".strip()
        os.execv(sys.executable, [sys.executable, *sys.argv])
    for name, value in (
        ("VLLM_CPU_OMP_THREADS_BIND", _cpu_ranges()),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        ("VLLM_CPU_KVCACHE_SPACE", "2"),
        ("HF_HUB_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
    ):
        os.environ.setdefault(name, value)


def main() -> None:
    checkpoint, prompts_file, output_len, concurrency = sys.argv[1:5]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
    _with_peer_environment()
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in json.loads(Path(prompts_file).read_text())]
    llm = LLM(
        model=checkpoint,
        dtype=dtype,
        max_model_len=4096,
        max_num_seqs=int(concurrency),
        max_num_batched_tokens=2048,  # its OpenAI server's CPU default (the LLM class's is 4096)
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    sampling = SamplingParams(max_tokens=int(output_len), ignore_eos=True, temperature=0.0)
    # reversed: on the timed prompts themselves its prefix cache would skip their prefill
    ids = [p["prompt_token_ids"] for p in prompts[: int(concurrency)]]
    llm.generate([{"prompt_token_ids": i[::-1]} for i in ids], sampling, use_tqdm=False)
    started = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == len(prompts) * int(output_len)
    print(json.dumps({"output_tok_s": generated / elapsed}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()
