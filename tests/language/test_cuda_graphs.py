"""Decode steps from CUDA graphs: the buckets (everywhere), and on a GPU that
padding rows write nothing but the sink page. Greedy outputs with graphs on
and off against HF: test_gpu_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.language.engine.cuda_graphs import graph_batch_sizes
from services.language.engine.request import SamplingParams
from tests.language.engine_fixtures import make_engine, make_request
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
def test_padding_rows_write_only_the_sink_page(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint, dtype=torch.bfloat16, device="cuda")
    engine.warm_up()
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.size_for(3) == 4
    for i in range(3):
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request(make_request(tiny_checkpoint, f"p{i}", chat("Hi", 0), [], sampling))
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
