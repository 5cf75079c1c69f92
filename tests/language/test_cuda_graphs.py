"""Decode steps from CUDA graphs: the buckets (everywhere); on a GPU, that
padding rows write nothing but the sink page, and that replays compute what
eager decode steps compute at head_dim 128 and the head ratios of real
checkpoints. Greedy outputs with graphs on and off against HF: test_gpu_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.language.engine.cuda_graphs import graph_batch_sizes
from services.language.engine.engine import LLMEngine
from services.language.engine.request import SamplingParams
from services.model.demo import build_demo_checkpoint, gpu_size
from tests.language.engine_fixtures import (
    count_replays,
    make_engine,
    make_request,
    run_to_completion,
)
from tests.reference import chat


def test_buckets_are_vllms_capture_sizes_up_to_the_batch_limit() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(64) == [1, 2, 4, *range(8, 65, 8)]


def test_no_graphs_and_no_sink_page_on_cpu(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    engine.warm_up()
    assert engine.runner.graphs is None
    cache = engine.runner.kv_cache
    assert cache.layers[0][0].shape[0] == cache.config.num_pages


@pytest.mark.gpu
def test_padding_rows_write_only_the_sink_page(gpu_checkpoint: Path) -> None:
    engine = make_engine(gpu_checkpoint, dtype=torch.bfloat16, device="cuda")
    engine.warm_up()
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.size_for(3) == 4
    for i in range(3):
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request(make_request(gpu_checkpoint, f"p{i}", chat("Hi", 0), [], sampling))
    engine.step()  # the prefills, eagerly
    running = list(engine.scheduler.running)
    slots = {
        (r.block_table[r.num_computed_tokens // 16], r.num_computed_tokens % 16) for r in running
    }
    before = [torch.stack(layer, 1) for layer in engine.runner.kv_cache.layers]
    engine.step()  # 3 decodes in the graph of 4
    sink = graphs.sink_page
    after = [torch.stack(layer, 1) for layer in engine.runner.kv_cache.layers]
    for old, new in zip(before, after, strict=True):
        # [pages, page_size]: whether a token's key or value changed
        changed = (old != new).flatten(3).any(-1).any(1)
        pages, offsets = changed.nonzero(as_tuple=True)
        written = {(int(p), int(o)) for p, o in zip(pages, offsets, strict=True)}
        assert written - {(sink, 0)} == slots


def _step_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """The logits of every step the engine runs from now on, on the host."""
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(batch: list) -> torch.Tensor:
        logits = execute(batch)
        steps.append(logits.cpu())
        return logits

    engine.runner.execute = recording  # type: ignore[method-assign]
    return steps


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [4, 7, 8])
def test_graph_replays_compute_what_eager_decode_does(
    tmp_path_factory: pytest.TempPathFactory, ratio: int
) -> None:
    """head_dim 128, `ratio` query heads a KV head (4: CUDA-core decode; 7 and 8:
    tensor cores). Three requests, one with n = 3 (its choices' page tables list
    the prompt's shared pages), 5 sequences in all, shrinking to 3: buckets 8 and
    4 replay with padding rows, and 20 decode steps cross page boundaries (16
    tokens a page). Each step's logits with graphs equal eager's to bf16's
    rounding, up to the first step where a greedy token differs (a near tie),
    past which the two runs no longer decode the same context."""
    folder = tmp_path_factory.mktemp(f"ratio-{ratio}")
    checkpoint = build_demo_checkpoint(folder, size=gpu_size(ratio))
    cases = [("Tell me a long story about the sea", 3, 20), ("Hi", 1, 12), ("Count", 1, 6)]
    logits: dict[bool, list[torch.Tensor]] = {}
    replayed: list[int] = []
    for graphs in (True, False):
        engine = make_engine(checkpoint, dtype=torch.bfloat16, device="cuda", cuda_graphs=graphs)
        engine.warm_up()
        if graphs:
            replayed = count_replays(engine)
        steps = _step_logits(engine)
        requests = [
            make_request(
                checkpoint,
                f"r{i}",
                chat(prompt, 0),
                [],
                SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                dtype=torch.bfloat16,
            )
            for i, (prompt, n, max_tokens) in enumerate(cases)
        ]
        run_to_completion(engine, requests)
        logits[graphs] = steps
        assert engine.blocks.num_used_pages == 0
    assert {8, 4} <= set(replayed)
    assert len(logits[True]) == len(logits[False])
    for step, (ours, eager) in enumerate(zip(logits[True], logits[False], strict=True)):
        torch.testing.assert_close(ours, eager, atol=5e-2, rtol=2e-2, msg=f"step {step}")
        if not torch.equal(ours.argmax(-1), eager.argmax(-1)):
            break
