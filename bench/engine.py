"""Engine throughput against Hugging Face generate(), same checkpoint, same run.

    .venv/bin/python -m bench.engine [--arch qwen2_5_vl] [--size small] [--concurrency 1 4 16]
        [--linear auto|torch|cpu|avx512|onednn|amx|avx512bf16] [--attention auto|torch|cpu]
        [--ops auto|torch|cpu]

For each concurrency c, c requests (same prompts, fixed output length) go to
the engine at once; the baseline is generate() on the same requests one at a
time, which is what a user of generate() gets. Prints output tokens/s of each
and the ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from services.language.engine.config import EngineConfig
from services.language.engine.engine import LLMEngine
from services.language.engine.request import SamplingParams, new_request
from services.language.engine.scheduler import SchedulerConfig
from services.layers.cpu_kernels import BF16_KINDS
from services.model.checkpoint import load_language_weights
from services.model.demo import ARCHS, SIZES, cached_demo_checkpoint
from services.model.spec import load_spec
from services.model.tokenizer import build_prompt, load_tokenizer
from services.runtime.malloc import keep_freed_memory

TOPICS = [
    "the sea",
    "a red bicycle",
    "the mountains",
    "a museum",
    "trains",
    "cooking",
    "weather",
    "cats",
]


def prompts(n: int) -> list[list[dict[str, object]]]:
    return [
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": f"Tell me about {TOPICS[i % len(TOPICS)]}, please. " * 3,
                    }
                ],
            }
        ]
        for i in range(n)
    ]


def text_prompts(engine: LLMEngine, tokens: int, count: int) -> list[list[int]]:
    """`count` text prompts of `tokens` token ids each, from the topics' words,
    each starting 7 tokens further in than the one before."""
    words = engine.tokenizer.encode(" ".join(TOPICS * 64))
    return [[words[(7 * i + j) % len(words)] for j in range(tokens)] for i in range(count)]


def hf_tokens_per_second(folder: str, token_ids: list[list[int]], output_len: int) -> float:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for ids in token_ids:
            inputs = torch.tensor([ids])
            started = time.perf_counter()
            out = model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                mm_token_type_ids=torch.zeros_like(inputs),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
            )
            total += time.perf_counter() - started
            assert out.shape[1] - inputs.shape[1] == output_len
    return len(token_ids) * output_len / total


def load_engine(folder: Path, config: EngineConfig) -> LLMEngine:
    """The language engine of a checkpoint, in this process, which keeps its
    freed memory as `epd serve`'s engine process does (keep_freed_memory)."""
    keep_freed_memory()
    spec = load_spec(folder)
    return LLMEngine(spec, load_language_weights(folder, spec), load_tokenizer(folder), config)


def engine_tokens_per_second(
    engine: LLMEngine, token_ids: list[list[int]], output_len: int
) -> float:
    for i, ids in enumerate(token_ids):
        engine.add_request(
            new_request(
                f"b{time.monotonic_ns()}-{i}",
                ids,
                SamplingParams(max_tokens=output_len, ignore_eos=True),
                engine.spec,
            )
        )
    started = time.perf_counter()
    generated = 0
    while engine.has_work():
        _, stats = engine.step()
        generated += stats.num_generated
    elapsed = time.perf_counter() - started
    assert generated == len(token_ids) * output_len
    return generated / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="qwen2_5_vl", choices=ARCHS)
    parser.add_argument("--size", default="small", choices=tuple(SIZES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--linear",
        default="auto",
        choices=("auto", "torch", "cpu", "avx512", "onednn", *BF16_KINDS),
        help="EngineConfig.linear",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        choices=("auto", "torch", "cpu"),
        help="EngineConfig.attention (cpu: the compiled paged decode kernel)",
    )
    parser.add_argument(
        "--ops",
        default="auto",
        choices=("auto", "torch", "cpu"),
        help="EngineConfig.ops (cpu: the compiled fused RMSNorm and rotary embedding)",
    )
    args = parser.parse_args()

    folder = cached_demo_checkpoint(args.size, args.arch)
    engine = load_engine(
        folder,
        EngineConfig(
            max_model_len=2048,
            kv_cache_bytes=1 << 30,
            scheduler=SchedulerConfig(max_num_seqs=64),
            linear=args.linear,
            attention=args.attention,
            ops=args.ops,
        ),
    )
    spec, tokenizer = engine.spec, engine.tokenizer
    print(
        f"checkpoint: demo {args.arch} {args.size} ({folder}), "
        f"output {args.output_len} tokens per request, torch threads {torch.get_num_threads()}, "
        f"projections: {args.linear}, attention: {args.attention}, norms and rotary: {args.ops}"
    )
    print(f"{'concurrency':>11} {'engine tok/s':>13} {'generate() tok/s':>17} {'ratio':>7}")
    for c in args.concurrency:
        ids = [build_prompt(tokenizer, spec, p, []).token_ids for p in prompts(c)]
        engine_tokens_per_second(engine, ids[:1], 4)  # warm-up
        engine_rate = engine_tokens_per_second(engine, ids, args.output_len)
        hf_rate = hf_tokens_per_second(str(folder), ids, args.output_len)
        print(
            f"{c:>11} {engine_rate:>13.1f} {hf_rate:>17.1f} {engine_rate / hf_rate:>6.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
