"""Soak: a mixed load near capacity for a long while, with a fault every minute.

    .venv/bin/python -m bench.soak [--minutes 10] [--fault-every 60] [--workers 6]

Starts `epd serve` (two language instances, two encoders, the tiny demo
checkpoint by default) and keeps `workers` requests in flight, text and image
alternating, each image new (the encoder's cache never answers). Every
`fault-every` seconds one component is killed with SIGKILL or frozen (SIGSTOP,
then SIGCONT after `freeze-seconds`: its connections stay up, nothing
answers), in turn: Triton killed, encoder-1 frozen, encoder-1 killed,
language-1 frozen, language-1 killed, the broker frozen, the broker killed,
Triton frozen. encoder-0, language-0 and the gateway are never touched, so
their memory tells whether anything leaks. The encoders' embedding caches are
bounded at `--encoder-cache-mb` (32 MiB by default here, filled in the first
minutes): a cache that fills to its bound is not a leak, but over an hour a
larger one would hide one.

Prints the requests completed and failed, every failure (status and cause)
under the fault whose window it ended in (from the fault to `freeze-seconds`
plus RECOVERY_S after it; one outside every window as unattributed), the
latency of those that completed (p50/p99), each component's resident memory at
the start of the load and at its end, and the pools at the end (after the load
stops and quarantines lapse): KV pages, embedding blocks and send buffers in
use, requests in flight.

Memory over time: every `--sample-every` seconds each component's resident
memory is sampled (a restarted one is a new process, its curve starts again);
for the components never touched it prints the growth from the end of the
warm-up (`--warm-up` minutes) to the end (the target: under 5 %), and with
`--plot` writes the curves (PNG, and the samples beside it as CSV).
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.launcher.serve import launch
from services.loadgen.stats import percentile
from services.loadgen.synthetic import encode_image, random_image
from services.model.demo import SIZES, cached_demo_checkpoint
from services.runtime.ports import free_port_block

MODEL = "soak"
FAULTS = (
    ("kill", "triton"),
    ("freeze", "encoder-1"),
    ("kill", "encoder-1"),
    ("freeze", "language-1"),
    ("kill", "language-1"),
    ("freeze", "broker"),
    ("kill", "broker"),
    ("freeze", "triton"),
)
# After a fault (a kill, or a freeze's end), how long requests may still fail
# for it: a restart's backoff and start (Triton's ~20 s under load), the broker
# hearing of it, keepalive noticing a frozen peer.
RECOVERY_S = 40.0


@dataclass(frozen=True)
class Ports:
    """gateway, broker, Triton's three; encoders at base + 20, + 21 and languages at
    base + 30, + 31 (their metrics 100 above)."""

    base: int = field(
        default_factory=lambda: free_port_block((0, 1, 2, 3, 4, 20, 21, 30, 31, 120, 121, 130, 131))
    )

    @property
    def gateway(self) -> int:
        return self.base

    @property
    def broker(self) -> int:
        return self.base + 1

    @property
    def triton(self) -> tuple[int, int, int]:
        return self.base + 2, self.base + 3, self.base + 4

    @property
    def encoder(self) -> int:
        return self.base + 20

    @property
    def language(self) -> int:
        return self.base + 30


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pids(markers: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Component name -> pid, by markers in the command line; Triton's Python
    backend stub (which holds the vision tower) as `triton-stub`."""
    found: dict[str, int] = {}
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            parents[int(entry.name)] = int((entry / "stat").read_text().split()[3])
        except (OSError, IndexError, ValueError):
            continue
        for name, needles in markers.items():
            if all(n in cmdline for n in needles):
                found[name] = int(entry.name)
    if "triton" in found:
        stubs = [pid for pid, parent in parents.items() if parent == found["triton"]]
        if stubs:
            found["triton-stub"] = stubs[0]
    return found


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@dataclass
class Memory:
    """Each component's resident memory over the soak: (seconds since start, MiB)."""

    markers: dict[str, tuple[str, ...]]
    every_s: float
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self, started: float) -> threading.Thread:
        def sample() -> None:
            while not self.stop.wait(0 if not self.curves else self.every_s):
                now = time.monotonic() - started
                for name, pid in _pids(self.markers).items():
                    try:
                        self.curves.setdefault(name, []).append((now, _rss_mib(pid)))
                    except OSError:  # it died between the two looks
                        continue

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        return thread

    def growth(self, warm_up_s: float) -> dict[str, tuple[float, float]]:
        """MiB at the first sample after the warm-up and at the last, per component."""
        out = {}
        for name, curve in self.curves.items():
            after = [mib for t, mib in curve if t >= warm_up_s]
            if len(after) >= 2:
                out[name] = (after[0], after[-1])
        return out

    def write(self, path: Path, faulted: set[str]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        with path.with_suffix(".csv").open("w") as out:
            out.write("component,seconds,rss_mib\n")
            for name, curve in sorted(self.curves.items()):
                out.writelines(f"{name},{t:.0f},{mib:.1f}\n" for t, mib in curve)
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for name, curve in sorted(self.curves.items()):
            style = "-" if name.removesuffix("-stub") not in faulted else ":"
            ax.plot([t / 60 for t, _ in curve], [m for _, m in curve], style, label=name)
        ax.set_xlabel("minutes")
        ax.set_ylabel("resident memory (MiB)")
        ax.set_title("soak: each component's memory (dotted: faulted, restarted)")
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        fig.savefig(path)
        print(f"memory curves: {path} ({path.with_suffix('.csv').name} beside it)")


@dataclass(frozen=True)
class Result:
    kind: str  # text or image
    started: float  # time.monotonic()
    seconds: float
    status: int  # HTTP, or -1 when the client failed
    cause: str = ""


@dataclass(frozen=True)
class Fault:
    action: str  # kill or freeze
    target: str
    at: float  # time.monotonic()
    until: float  # when requests stop failing for it (see RECOVERY_S)


def attribute(failures: list[Result], faults: list[Fault]) -> dict[Fault | None, list[Result]]:
    """Each failure to the latest fault whose window holds its end; None for
    one outside every window."""
    out: dict[Fault | None, list[Result]] = {}
    for r in failures:
        ended = r.started + r.seconds
        within = [f for f in faults if f.at <= ended <= f.until]
        out.setdefault(within[-1] if within else None, []).append(r)
    return out


@dataclass
class Load:
    url: str
    workers: int
    max_tokens: int
    results: list[Result] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def _body(self, kind: str, seed: int) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Tell me about {seed}."}]
        if kind == "image":
            image = encode_image(random_image(96 + seed % 160, 96 + seed % 96, seed=seed))
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
        }

    def _work(self, worker: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                n += 1
                kind = "image" if (n + worker) % 2 else "text"
                started = time.monotonic()
                try:
                    reply = http.post(
                        self.url + "/v1/chat/completions",
                        json=self._body(kind, worker * 10_000_000 + n),
                    )
                    status = reply.status_code
                    cause = "" if status == 200 else reply.json()["error"]["message"][:70]
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    status, cause = -1, type(exc).__name__
                self.results.append(
                    Result(kind, started, time.monotonic() - started, status, cause)
                )

    def start(self) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(self.workers)
        ]
        for thread in threads:
            thread.start()
        return threads


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds")
    parser.add_argument("--freeze-seconds", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=6, help="requests kept in flight")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--demo-size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--encoder-cache-mb", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds")
    parser.add_argument(
        "--warm-up", type=float, default=10.0, help="minutes before memory growth counts"
    )
    parser.add_argument("--plot", type=Path, help="PNG of every component's memory over time")
    args = parser.parse_args()

    ports = Ports()
    checkpoint = cached_demo_checkpoint(args.demo_size)
    # fmt: off
    process = launch([
        "--model", str(checkpoint), "--model-name", MODEL,
        "--port", str(ports.gateway), "--broker-port", str(ports.broker),
        "--encoder-port", str(ports.encoder), "--language-port", str(ports.language),
        "--triton-http-port", str(ports.triton[0]), "--triton-grpc-port", str(ports.triton[1]),
        "--triton-metrics-port", str(ports.triton[2]),
        "--languages", "2", "--encoders", "2",
        # Faults are planned: no crash loop should stop the stack.
        "--max-restarts", "100",
        "--encoder-cache-mb", str(args.encoder_cache_mb),
    ])
    # fmt: on
    supervisor: list[str] = []
    threading.Thread(target=lambda: supervisor.extend(process.stdout or ()), daemon=True).start()
    broker = f":{ports.broker}"
    markers = {
        "gateway": ("services.launcher.cli gateway", f"--broker 127.0.0.1{broker}"),
        "broker": ("services.launcher.cli broker", f"--port {ports.broker}"),
        "triton": ("bin/tritonserver", f"--grpc-port={ports.triton[1]}"),
        **{
            f"{role}-{i}": (f"services.launcher.cli {role}", f"--instance-id {role}-{i}", broker)
            for role in ("encoder", "language")
            for i in range(2)
        },
    }
    load = Load(f"http://127.0.0.1:{ports.gateway}", args.workers, args.max_tokens)
    try:
        threads = load.start()
        time.sleep(10)  # warm: every component has served, caches and pools are in use
        rss_start = {name: _rss_mib(pid) for name, pid in _pids(markers).items()}
        started = time.monotonic()
        memory = Memory(markers, args.sample_every)
        memory.start(started)
        end = started + args.minutes * 60
        faults: list[Fault] = []
        while time.monotonic() < end:
            time.sleep(max(0.0, min(args.fault_every, end - time.monotonic())))
            if time.monotonic() >= end:
                break
            action, target = FAULTS[len(faults) % len(FAULTS)]
            pid = _pids({target: markers[target]}).get(target)
            if pid is not None:
                at = time.monotonic()
                if action == "kill":
                    os.kill(pid, signal.SIGKILL)
                    faults.append(Fault(action, target, at, at + RECOVERY_S))
                else:
                    os.kill(pid, signal.SIGSTOP)
                    threading.Timer(args.freeze_seconds, os.kill, (pid, signal.SIGCONT)).start()
                    until = at + args.freeze_seconds + RECOVERY_S
                    faults.append(Fault(action, target, at, until))
                print(f"{at - started:6.0f}s  {action} {target}", flush=True)
        rss_end = {name: _rss_mib(pid) for name, pid in _pids(markers).items()}
        memory.stop.set()
        load.stop.set()
        for thread in threads:
            thread.join(180)
        touched = {f.target for f in faults}
        _report(load, ports, rss_start, rss_end, faults, started)
        print(f"memory growth after the first {args.warm_up:g} min (never touched; goal: < 5 %):")
        for name, (first, last) in sorted(memory.growth(args.warm_up * 60).items()):
            if name.removesuffix("-stub") not in touched:
                print(f"  {name:<12} {first:8.1f} -> {last:8.1f} MiB  {last / first - 1:+6.1%}")
        if args.plot:
            memory.write(args.plot, touched)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()


def _report(
    load: Load,
    ports: Ports,
    rss_start: dict[str, float],
    rss_end: dict[str, float],
    faults: list[Fault],
    started: float,
) -> None:
    done = [r for r in load.results if r.status == 200]
    failed = [r for r in load.results if r.status != 200]
    minutes = (time.monotonic() - started) / 60
    print(f"\n{minutes:.1f} min, {len(faults)} faults")
    print(f"requests: {len(done)} completed, {len(failed)} failed")
    for kind in ("text", "image"):
        ok = sorted(r.seconds for r in done if r.kind == kind)
        if ok:
            print(
                f"  {kind:<6} {len(ok):>6} ok   latency p50 {percentile(ok, 50):.2f} s  "
                f"p99 {percentile(ok, 99):.2f} s"
            )
    print("failures by the fault whose window they ended in:")
    by_fault = attribute(failed, faults)
    for fault in [*faults, None]:
        causes = Counter((r.status, r.cause) for r in by_fault.get(fault, ()))
        name = "unattributed"
        if fault:
            name = f"{fault.at - started:6.0f}s {fault.action} {fault.target}"
        print(f"  {name:<26} {sum(causes.values()):>5} failed")
        for (status, cause), count in causes.most_common():
            print(f"  {count:>10} x {status}  {cause}")
    print("resident memory (MiB), start of the load -> end (restarted ones are new processes):")
    touched = {f.target for f in faults}
    for name in sorted(rss_start):
        kept = "" if name.removesuffix("-stub") in touched else "   (never touched)"
        print(f"  {name:<12} {rss_start[name]:8.1f} -> {rss_end.get(name, 0.0):8.1f}{kept}")
    time.sleep(20)  # quarantines lapse, restarted components settle
    print("pools at the end:")
    for i in range(2):
        port = ports.language + i + 100
        print(
            f"  language-{i}: KV pages used "
            f"{_metric(port, 'epd_language_kv_blocks_used'):.0f}, embedding blocks used "
            f"{_metric(port, 'epd_language_embedding_blocks_used'):.0f} "
            f"(quarantined {_metric(port, 'epd_language_embedding_blocks_quarantined'):.0f})"
        )
        port = ports.encoder + i + 100
        print(
            f"  encoder-{i}: send buffer bytes used "
            f"{_metric(port, 'epd_encoder_send_buffer_bytes'):.0f}, embedding cache "
            f"{_metric(port, 'epd_encoder_cache_bytes') / 2**20:.1f} MiB (bounded by --cache-mb)"
        )
    print(f"  gateway in flight: {_metric(ports.gateway, 'epd_gateway_in_flight'):.0f}")


if __name__ == "__main__":
    main()
