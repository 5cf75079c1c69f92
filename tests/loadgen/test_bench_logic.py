"""Workloads, arrivals and summaries of `epd bench`, as pure logic."""

from __future__ import annotations

import base64
import itertools
import math
import statistics
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from services.loadgen.client import RequestResult
from services.loadgen.runner import RunResult, arrival_times
from services.loadgen.stats import percentile
from services.loadgen.summary import meets, summarize
from services.loadgen.workload import Workload, build_requests


def test_workload_is_deterministic_and_mixes_exactly() -> None:
    workload = Workload(
        num_prompts=40, image_ratio=0.1, images_per_request=2, image_size=(64, 48), seed=3
    )
    a, b = build_requests(workload, "m"), build_requests(workload, "m")
    assert [r.body for r in a] == [r.body for r in b]
    assert sum(r.kind == "image" for r in a) == 4
    image = next(r for r in a if r.kind == "image")
    parts = image.body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert parts[0] != parts[1]  # distinct images: no cache hit within a run
    assert image.body["max_tokens"] == 64 and image.body["ignore_eos"] is True
    assert image.body["stream_options"] == {"include_usage": True}


def test_videos_mix_with_images_and_text_and_are_readable_videos() -> None:
    from services.model.video import probe

    workload = Workload(
        num_prompts=20, image_ratio=0.25, video_ratio=0.5, video_frames=6, video_size=(32, 32)
    )
    requests = build_requests(workload, "m")
    assert [sum(r.kind == k for r in requests) for k in ("image", "video", "text")] == [5, 10, 5]
    videos = [r.body["messages"][0]["content"][0] for r in requests if r.kind == "video"]
    assert all(v["type"] == "video_url" for v in videos)
    first = base64.b64decode(videos[0]["video_url"]["url"].partition(",")[2])
    info = probe(first)
    assert (info.num_frames, info.width, info.height, info.fps) == (6, 32, 32, 4.0)
    assert len({v["video_url"]["url"] for v in videos}) == 10  # distinct: no cache hits
    with pytest.raises(ValueError, match="video_ratio"):
        Workload(image_ratio=0.6, video_ratio=0.5)


def test_distinct_images_draw_from_a_pool_and_recur() -> None:
    """--distinct-images K: every image is one of K, each recurs across requests,
    none twice in one request; without it every image is new."""
    workload = Workload(
        num_prompts=60, images_per_request=2, distinct_images=5, image_size=(32, 32), seed=4
    )
    requests = build_requests(workload, "m")
    urls = [
        [p["image_url"]["url"] for p in r.body["messages"][0]["content"] if "image_url" in p]
        for r in requests
    ]
    assert all(len(set(pair)) == 2 for pair in urls)
    seen = [url for pair in urls for url in pair]
    assert len(set(seen)) == 5 and len(seen) == 120
    fresh = build_requests(replace(workload, distinct_images=0, num_prompts=6), "m")
    assert (
        len({p["image_url"]["url"] for r in fresh for p in r.body["messages"][0]["content"][:2]})
        == 12
    )
    with pytest.raises(ValueError, match="distinct_images"):
        Workload(images_per_request=3, distinct_images=2)


def test_a_skewed_pool_has_a_few_popular_images_among_many() -> None:
    """--image-skew S: the pool's k-th image comes with weight 1/k**S: the most
    popular one far more often than the median one; still none twice in a request."""
    workload = Workload(
        num_prompts=400, distinct_images=40, image_skew=1.2, image_size=(16, 16), seed=3
    )
    urls = [
        p["image_url"]["url"]
        for r in build_requests(workload, "m")
        for p in r.body["messages"][0]["content"]
        if "image_url" in p
    ]
    counts = sorted(Counter(urls).values(), reverse=True)
    assert counts[0] > 10 * counts[len(counts) // 2]
    even = Counter(
        p["image_url"]["url"]
        for r in build_requests(replace(workload, image_skew=0.0), "m")
        for p in r.body["messages"][0]["content"]
        if "image_url" in p
    )
    assert len(even) == 40 and 4 * max(even.values()) < counts[0]  # evenly: no image that popular
    pairs = build_requests(replace(workload, images_per_request=2, num_prompts=50), "m")
    assert all(
        len({p["image_url"]["url"] for p in r.body["messages"][0]["content"][:2]}) == 2
        for r in pairs
    )
    with pytest.raises(ValueError, match="image_skew"):
        Workload(image_skew=1.0)


def test_other_seed_other_workload() -> None:
    a = build_requests(Workload(num_prompts=5, image_ratio=0.0, seed=1), "m")
    b = build_requests(Workload(num_prompts=5, image_ratio=0.0, seed=2), "m")
    assert a[0].body != b[0].body


def test_bad_workloads() -> None:
    with pytest.raises(ValueError, match="image_ratio"):
        Workload(image_ratio=1.5)
    with pytest.raises(ValueError, match="image format"):
        Workload(image_format="bmp")


def test_poisson_arrivals() -> None:
    times = arrival_times(4000, rate=8.0, seed=0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_percentile() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def _result(
    index: int, kind: str, ttft: float, e2e: float, tokens: int, ok: bool = True
) -> RequestResult:
    return RequestResult(
        index,
        kind,
        0.0,
        ok=ok,
        ttft=ttft,
        e2e=e2e,
        output_tokens=tokens,
        prompt_tokens=10,
        itls=[(e2e - ttft) / (tokens - 1)] * (tokens - 1),
        error="" if ok else "boom",
    )


def test_summary_counts_throughput_percentiles_and_goodput() -> None:
    results = [
        _result(0, "text", 0.1, 1.1, 11),  # TPOT 100 ms
        _result(1, "text", 0.2, 0.7, 11),  # TPOT 50 ms
        _result(2, "image", 1.0, 2.0, 11),  # TTFT 1 s
        _result(3, "image", 0.0, 0.0, 0, ok=False),
    ]
    summary = summarize(RunResult(2.0, duration_s=4.0, results=results), {"ttft": 500, "tpot": 80})
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert summary["errors"] == ["boom"]
    assert summary["request_throughput"] == pytest.approx(0.75)
    assert summary["output_throughput"] == pytest.approx(33 / 4)
    assert summary["by_kind"]["text"]["latency_ms"]["tpot"]["median"] == pytest.approx(75)
    assert summary["by_kind"]["image"]["completed"] == 1
    assert summary["goodput"] == pytest.approx(1 / 4)  # only request 1 meets both SLOs
    assert summary["slo_attainment"] == pytest.approx(1 / 4)  # of the 4 sent
    assert meets(results[1], {"ttft": 500, "tpot": 80})
    assert not meets(results[0], {"tpot": 80})


def test_the_peer_section_is_replaced_and_the_rest_of_the_page_kept() -> None:
    """bench/peer.py writes its section once and replaces it on the next run,
    leaving the rest of docs/performance.md as it was."""
    from bench.peer import with_section

    first = with_section("# Performance\n\nhow to read it\n", "vs vLLM: run 1")
    assert first.startswith("# Performance\n\nhow to read it\n\n")
    second = with_section(first + "\ntrailing text\n", "vs vLLM: run 2")
    assert "run 1" not in second and second.count("vs vLLM") == 1
    assert second.endswith("\ntrailing text\n")


def test_the_monolithic_report_has_a_page_of_its_own() -> None:
    """bench/report.py rewrites its whole page: not docs/performance.md, which
    the other scripts write their sections into."""
    from bench.report import DOC, MONOLITHIC, outputs

    assert outputs("qwen2_5_vl")[0] == MONOLITHIC != DOC


def test_each_cpu_class_and_demo_size_has_its_own_peer_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run replaces the section of its CPU class and demo size (and EPD's dtype,
    where not the class's own) only; all stay in bench/peer.py's block, which a
    the page keeps."""
    from bench import peer

    doc = "# Performance\n"
    for cpu, size, run in [("AVX2", "small", 1), ("AVX512-BF16", "small", 1), ("AVX2", "small", 2)]:
        monkeypatch.setattr(peer, "cpu_class", lambda cpu=cpu: cpu)
        doc = peer.with_peer_section(doc, f"{cpu} {size}: run {run}", size)
    monkeypatch.setattr(peer, "cpu_class", lambda: "AVX512-BF16")
    doc = peer.with_peer_section(doc, "AVX512-BF16 medium: run 1", "medium")
    doc = peer.with_peer_section(doc, "AVX512-BF16 small float32: run 1", "small", "float32")
    assert "AVX2 small: run 1" not in doc
    assert "<!-- bench/peer.py: AVX512-BF16, small demo, float32: start -->" in doc
    sections = [
        "AVX2 small: run 2",
        "AVX512-BF16 small: run 1",
        "AVX512-BF16 medium: run 1",
        "AVX512-BF16 small float32: run 1",
    ]
    assert [doc.index(s) for s in sections] == sorted(doc.index(s) for s in sections)
    assert all(doc.count(s) == 1 for s in sections)


def test_the_pd_section_is_kept_beside_the_peer_section() -> None:
    """bench/pd.py's section has its own markers: writing it leaves the peer's
    alone, and the encoder benchmarks' likewise."""
    from bench.peer import with_section
    from bench.report import CACHE_END, CACHE_START, PD_END, PD_START, PLANNER_END, PLANNER_START

    doc = with_section("# Performance\n", "vs vLLM")
    doc = with_section(doc, "E/P/D: run 1", PD_START, PD_END)
    doc = with_section(doc, "E/P/D: run 2", PD_START, PD_END)
    assert doc.count("vs vLLM") == 1 and "run 1" not in doc and doc.count("E/P/D: run 2") == 1
    doc = with_section(doc, "cache routing", CACHE_START, CACHE_END)
    doc = with_section(doc, "planner timeline", PLANNER_START, PLANNER_END)
    assert "vs vLLM" in doc and "E/P/D: run 2" in doc
    assert "cache routing" in doc and "planner timeline" in doc


def test_report_of_another_family_goes_to_its_own_page() -> None:
    from bench.report import FIGURES, MONOLITHIC, outputs

    assert outputs("qwen2_5_vl") == (MONOLITHIC, FIGURES)
    doc, figures = outputs("qwen3_vl_moe")
    assert doc.name == "performance-monolithic-qwen3_vl_moe.md"
    assert figures.name == "performance-qwen3_vl_moe"
    assert doc.parent == figures.parent == MONOLITHIC.parent


def test_the_peer_engine_alone_command_gets_the_prompts_and_its_figure_is_read(
    tmp_path: Path,
) -> None:
    """--peer-engine-alone's command gets the token ids in a JSON file and the
    run's numbers through its placeholders; its figure is read from its output's
    last {"output_tok_s": ...} line, whatever it logs around it."""
    from bench.peer import CONCURRENCY, peer_engine_alone

    script = tmp_path / "alone.py"
    script.write_text(
        "import json, sys\n"
        "ck, prompts, out_len, conc = sys.argv[1:]\n"
        "ids = json.load(open(prompts))\n"
        "print('warming up')\n"
        "print(json.dumps({'output_tok_s': len(ids) * 1000 + sum(map(len, ids)) * 10"
        " + int(out_len) + int(conc) / 100, 'checkpoint': ck}))\n"
        "print('shutting down')\n"
    )
    command = f"{sys.executable} {script} {{checkpoint}} {{prompts}} {{output_len}} {{concurrency}}"
    figure = peer_engine_alone(command, tmp_path / "a checkpoint", [[1, 2, 3], [4]], 64)
    assert figure == 2 * 1000 + 4 * 10 + 64 + CONCURRENCY / 100
    with pytest.raises(ValueError, match=r"no .*output_tok_s"):
        peer_engine_alone("echo loading; echo done", tmp_path, [[1]], 64)


def test_the_stack_cost_names_each_server_and_the_engines_side_by_side() -> None:
    from bench.peer import stack_cost

    epd = {"text": {"output_throughput": 900.0}, "engine_alone_tok_s": 1800.0}
    peer = {"text": {"output_throughput": 1200.0}, "engine_alone_tok_s": 2000.0}
    assert stack_cost({"epd": epd, "peer": peer}, "vLLM bf16") == (
        "EPD's stack on the text workload: 900.0 output tok/s, its engine alone 1800.0 "
        "(0.50x); vLLM bf16's stack on the text workload: 1200.0 output tok/s, its engine "
        "alone 2000.0 (0.60x); the engines alone, EPD / vLLM bf16: 0.90x"
    )
    without = {"text": {"output_throughput": 1200.0}}
    assert stack_cost({"epd": epd, "peer": without}, "vLLM") == (
        "EPD's stack on the text workload: 900.0 output tok/s, its engine alone 1800.0 (0.50x)"
    )


def test_each_process_is_named_as_the_cpu_figures_name_it() -> None:
    from bench.peer import process_name
    from services.language.engine.process import CHILD

    python = "/work/main/.venv/bin/python"
    assert (
        process_name([python, "-m", "services.launcher.cli", "gateway", "--port", "1"]) == "gateway"
    )
    assert process_name([python, "-c", CHILD, "5", "77"]) == "language engine"
    module = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert process_name(module) == "api_server"
    assert process_name(["VLLM::Worker"]) == "VLLM::Worker"
    assert process_name(["/usr/bin/tritonserver", "--model-repository", "r"]) == "tritonserver"


def test_the_cpu_an_output_token_counts_each_process_and_the_client() -> None:
    """A real process spins ~0.3 s of CPU and this one (the client) ~0.2 s between
    the snapshot and the reading: over 1000 tokens, each at least most of that."""
    import subprocess
    import time

    from bench.peer import CpuSnapshot, process_name

    spin = "import sys, time\nsys.stdin.readline()\nend = time.process_time() + 0.3\n"
    spin += "while time.process_time() < end: pass\nprint('spun', flush=True)\nsys.stdin.read()\n"
    command = [sys.executable, "-c", spin]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None
        time.sleep(0.2)  # started: the snapshot sees it
        before = CpuSnapshot.now()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline() == "spun\n"
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass
        us = before.per_token(1000)
        p.stdin.close()
    assert us[process_name(command)] >= 250  # its 0.3 s, and any other such process's
    assert 180 <= us["client"] < 400
    assert list(us.values()) == sorted(us.values(), reverse=True)


def test_the_cpu_cost_names_each_process_and_all_but_the_engine() -> None:
    from bench.peer import cpu_cost

    epd = {
        "text": {"cpu_us_per_token": {"language engine": 1000.0, "gateway": 80.0, "client": 70.0}}
    }
    peer = {"text": {"cpu_us_per_token": {"VLLM::Worker": 1400.0, "client": 75.0}}}
    assert cpu_cost({"epd": epd, "peer": peer}, "vLLM") == (
        "CPU an output token on the text workload, by process (us): EPD: language engine "
        "1000, gateway 80, client 70 (all but the engine, client included: 150); vLLM: "
        "VLLM::Worker 1400, client 75 (all but the engine, client included: 75)"
    )
    assert cpu_cost({"epd": {"text": {}}, "peer": {"text": {}}}, "vLLM") == ""


def test_the_peer_runs_closed_or_open_loop_and_counts_goodput_where_asked() -> None:
    """bench/peer.py: 16 in flight by default; --request-rate sends Poisson
    arrivals with no cap on those in flight; --goodput adds each workload's
    goodput to the figures."""
    from bench.peer import CONCURRENCY, Arrivals, figures

    closed, opened = Arrivals().config("u"), Arrivals(rate=0.8).config("u")
    assert (closed.max_concurrency, closed.request_rate) == (CONCURRENCY, math.inf)
    assert (opened.max_concurrency, opened.request_rate) == (None, 0.8)
    summary = {"request_throughput": 1.0, "output_throughput": 1.0, "latency_ms": {}}
    probe = {"probes": summary | {"failed": 0}, "load": summary | {"failed": 0}}
    result = {"text": summary | {"failed": 0}, "image": summary | {"failed": 0, "goodput": 0.4}}
    one_at_a_time = {"latency_ms": {"ttft": {"median": 700.0}}, "failed": 1}
    alone = {"one image alone": one_at_a_time, "four images alone": one_at_a_time}
    named = figures(result | alone | {"probe": probe, "startup_s": 1.0})
    assert named["image goodput (req/s)"] == 0.4 and "text goodput (req/s)" not in named
    assert named["one image alone TTFT p50 (ms)"] == 700.0 and named["failed"] == 2


def test_the_goodput_headline_is_at_the_peers_peak_and_each_class_has_its_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import goodput
    from bench.goodput import Point, headline, holding, table, with_class_section

    def points(goodputs: list[float], attained: list[float]) -> list[Point]:
        return [
            Point(0.5 * (i + 1), g, 10, 0, 1.0, 2.0, 3.0, 4.0, a)
            for i, (g, a) in enumerate(zip(goodputs, attained, strict=True))
        ]

    epd = points([0.5, 1.0, 1.4, 1.2], [1.0, 1.0, 0.95, 0.6])
    peer = points([0.5, 0.9, 0.7, 0.3], [1.0, 0.9, 0.5, 0.2])
    assert headline(epd, peer) == (1.0, pytest.approx(1.0 / 0.9))
    rows = table(epd, peer, "vLLM")
    assert len(rows) == 2 + 4 and "| 1.50 | 1.40 | 0.70 | 2.00x | 95% / 50% |" in rows[4]
    assert "EPD 1.50, vLLM 1.00 req/s; EPD / vLLM 1.50x" in holding(epd, peer, "vLLM")
    epd = points([0.5, 1.0, 1.4, 1.9], [1.0, 1.0, 1.0, 0.95])
    assert "EPD at least 2.00, vLLM 1.00" in holding(epd, peer, "vLLM")
    doc = "# Goodput\n"
    for cpu, run in [("AVX2", 1), ("AVX512-BF16", 1), ("AVX2", 2)]:
        monkeypatch.setattr(goodput, "cpu_class", lambda cpu=cpu: cpu)
        doc = with_class_section(doc, f"{cpu}: run {run}", "small")
    assert "AVX2: run 1" not in doc and doc.count("AVX2: run 2") == 1
    assert doc.index("AVX2: run 2") < doc.index("AVX512-BF16: run 1")


def test_the_decode_bandwidth_row_of_a_class_replaces_only_its_own() -> None:
    """bench/decode_bandwidth.py --doc: a class's new row takes the place of its
    old one; the other classes' rows stay."""
    from bench.decode_bandwidth import END, START, _section

    avx2 = "| AVX2 | 2026-11-01 | abc | torch.float32 | 20.0 | 81% | 60% | 50% |"
    old = "| AVX512-BF16 + AVX-512 | 2026-11-02 | def | torch.bfloat16 | 30.0 | 80% | 40% | 30% |"
    new = "| AVX512-BF16 + AVX-512 | 2026-11-29 | 123 | torch.bfloat16 | 33.0 | 88% | 47% | 79% |"
    doc = f"# Performance\n\n{START}\n{_section('', avx2)}\n{END}\n"
    doc = doc.replace(avx2, f"{avx2}\n{old}")
    section = _section(doc, new)
    assert avx2 in section and new in section and old not in section
    assert section.count("| CPU class") == 1


def test_a_report_names_its_commit_and_says_when_the_code_differed_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A figure taken while services/ was being edited measured no commit: the
    report says so; an edited page elsewhere (docs/) is not the stack's code."""
    from bench import report

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    (tmp_path / "services").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "services" / "engine.py").write_text("x = 1\n")
    (tmp_path / "docs" / "performance.md").write_text("# figures\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    commit = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(report, "REPO", tmp_path)
    (tmp_path / "docs" / "performance.md").write_text("# new figures\n")
    assert report.head_commit() == commit
    (tmp_path / "services" / "engine.py").write_text("x = 2\n")
    assert report.head_commit() == f"{commit} + changes"


def test_each_requests_ttft_is_set_against_its_own_compute_alone() -> None:
    from bench.breakdown import over_alone

    # (preprocessing, tower on one image, prefill) a request; two images a request
    samples = [(10.0, 100.0, 50.0), (10.0, 200.0, 50.0), (10.0, 100.0, 50.0)]
    parts, floor, ratio = over_alone(2, [300.0, 500.0, 450.0], samples)
    assert parts == (10.0, 100.0, 50.0)
    assert floor == 260.0
    # 300/260, 500/460 and 450/260: each over its own, not the medians' ratio (450/260)
    assert ratio == 300.0 / 260.0
