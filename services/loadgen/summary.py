"""What a run measured: throughput, latency percentiles, goodput, per request kind."""

from __future__ import annotations

from typing import Any

from services.loadgen.client import RequestResult
from services.loadgen.runner import RunResult
from services.loadgen.stats import mean, percentile

METRICS = ("ttft", "tpot", "itl", "e2e")


def samples(results: list[RequestResult], metric: str) -> list[float]:
    if metric == "itl":
        return [x for r in results for x in r.itls]
    values = [getattr(r, metric) for r in results]
    return [v for v in values if v is not None]


def latency(results: list[RequestResult]) -> dict[str, dict[str, float]]:
    """Per metric, in milliseconds: mean, median, p90, p99."""
    out = {}
    for metric in METRICS:
        values = [1000 * v for v in samples(results, metric)]
        out[metric] = {
            "mean": mean(values),
            "median": percentile(values, 50),
            "p90": percentile(values, 90),
            "p99": percentile(values, 99),
        }
    return out


def meets(result: RequestResult, slo_ms: dict[str, float]) -> bool:
    for metric, limit in slo_ms.items():
        value = result.ttft if metric == "ttft" else result.tpot if metric == "tpot" else result.e2e
        if value is not None and 1000 * value > limit:
            return False
    return result.ok


def summarize(run: RunResult, slo_ms: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    duration = run.duration_s
    summary: dict[str, Any] = {
        "request_rate": run.request_rate,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if not r.ok})[:10],
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "latency_ms": latency(ok),
        "by_kind": {},
    }
    if slo_ms:
        good = sum(meets(r, slo_ms) for r in ok)
        summary["goodput"] = good / duration
        summary["slo_attainment"] = good / len(run.results) if run.results else 0.0
        summary["slo_ms"] = slo_ms
    for kind in sorted({r.kind for r in run.results}):
        subset = [r for r in ok if r.kind == kind]
        summary["by_kind"][kind] = {
            "completed": len(subset),
            "request_throughput": len(subset) / duration,
            "latency_ms": latency(subset),
        }
    return summary


def render(summary: dict[str, Any]) -> str:
    """A table for the terminal."""
    rate = summary["request_rate"]
    lines = [
        f"request rate        {'burst' if rate == float('inf') else f'{rate:g} req/s'}",
        f"completed / failed  {summary['completed']} / {summary['failed']}"
        f"  in {summary['duration_s']:.1f}s",
        f"request throughput  {summary['request_throughput']:.3f} req/s",
        f"output throughput   {summary['output_throughput']:.1f} tok/s",
    ]
    if "goodput" in summary:
        lines.append(
            f"goodput             {summary['goodput']:.3f} req/s  (SLO {summary['slo_ms']} ms)"
        )
    lines.append(f"{'':<20}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}   (ms)")
    for kind, part in [("all", summary), *summary["by_kind"].items()]:
        for metric in METRICS:
            row = part["latency_ms"][metric]
            lines.append(
                f"{kind + ' ' + metric:<20}"
                + "".join(f"{row[q]:>10.1f}" for q in ("mean", "median", "p90", "p99"))
            )
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
