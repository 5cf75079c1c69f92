"""Starts, watches and stops a local `tritonserver` for the model repository.

The binary, the Python backend and its stubs ship inside the nvidia-pytriton
wheel. The launcher assembles a backend folder with the stub for this Python,
points the stub at this environment's site-packages (it runs in isolated mode),
names the backend's shared-memory regions with a unique prefix so they can be
removed however the server ends, and waits for the server and the model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import secrets
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime import env
from services.runtime.children import die_with_parent
from services.runtime.ports import (
    TRITON_GRPC_PORT,
    TRITON_HTTP_PORT,
    TRITON_METRICS_PORT,
    listened_on,
)
from services.transfer.shared_memory import remove_segments

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Where tritonserver says why the model did not load; the cause runs up to the
# first (escaped) newline of the message, the traceback follows it.
TRITON_KEEPALIVE_FLAGS = (
    "--grpc-keepalive-permit-without-calls=true",
    "--grpc-http2-min-recv-ping-interval-without-data=4000",
    "--grpc-http2-max-ping-strikes=0",
)
# What tritonserver logs, once asked to stop, when no inference is in flight any more.
_DRAINED = "All models are stopped, unloading models"
_CAUSE = re.compile(
    r"(?:failed to load '[^']*' version \d+|Failed to initialize Python stub|"
    r"failed to load model '[^']*'): (?:Internal: )?(?P<cause>.+?)(?:\\n|\"$|$)"
)
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"


class TritonError(RuntimeError):
    """Triton could not be found, started, or did not become ready."""


@dataclass(frozen=True, slots=True)
class TritonConfig:
    checkpoint: Path
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    model_name: str = "vit"
    host: str = "127.0.0.1"
    http_port: int = TRITON_HTTP_PORT
    grpc_port: int = TRITON_GRPC_PORT
    metrics_port: int = TRITON_METRICS_PORT
    model_config_name: str | None = None  # e.g. "gpu" selects configs/gpu.pbtxt
    startup_timeout_s: float = 180.0
    log_verbose: int = 0
    dtype: str = field(default_factory=env.DTYPE.get)  # the vision tower's: a name, or auto
    # Triton's own OpenTelemetry tracing, exported here (OTLP/HTTP); "": off
    otlp_endpoint: str = field(default_factory=env.TRITON_OTLP_ENDPOINT.get)

    def __post_init__(self) -> None:
        if not (self.model_repository / self.model_name / "config.pbtxt").is_file():
            raise TritonError(
                f"no {self.model_name}/config.pbtxt in model repository {self.model_repository}"
            )

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


def _tracing_flags(endpoint: str) -> list[str]:
    """Triton's OpenTelemetry mode: every request traced, its span the child of
    the caller's `traceparent` (the encoder sends it), with the queue and
    compute times as events and a compute span, exported over OTLP/HTTP."""
    settings = (
        "mode=opentelemetry",
        "rate=1",
        "level=TIMESTAMPS",
        f"opentelemetry,url={endpoint}",
        "opentelemetry,resource=service.name=epd-triton",
        "opentelemetry,resource=epd.component=triton",
    )
    return [arg for setting in settings for arg in ("--trace-config", setting)]


def _python_library_dir() -> str:
    """The folder of this interpreter's libpython, when it has a shared one.

    The wheel's stub links libpython3.X.so.1.0 by name, so the loader would take
    the system's, while the stub finds its standard library through the first
    python3 on PATH (an activated venv's: this interpreter's). A system library
    and this interpreter's stdlib of another patch release do not mix
    (`undefined symbol: _PyModule_Add`): putting this interpreter's own library
    first keeps the two the same Python.
    """
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return str(libdir)
    return ""


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """Where the wheel keeps the server binary, its libraries and the backend."""

    binary: Path
    libs: Path
    python_backend: Path
    stub: Path

    @classmethod
    def find(cls) -> TritonInstall:
        # Located, not imported: importing pytriton pulls in its own client's deps.
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonError(
                "tritonserver not found: install the nvidia-pytriton wheel "
                "(pip install --no-deps nvidia-pytriton==0.7.0)"
            )
        root = Path(next(iter(spec.submodule_search_locations))).resolve() / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(
            binary=root / "bin" / "tritonserver",
            libs=root.parent.parent / "nvidia_pytriton.libs",
            python_backend=root / "backends" / "python",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        )
        for path in (install.binary, install.python_backend, install.stub):
            if not path.exists():
                raise TritonError(f"tritonserver install is incomplete: {path} is missing")
        return install


@dataclass
class TritonServer:
    """A tritonserver child process. Use as a context manager, or start()/stop()."""

    config: TritonConfig
    _process: subprocess.Popen[bytes] | None = None
    _workdir: Path | None = None
    _shm_prefix: str = field(
        default_factory=lambda: f"{env.SHM_PREFIX.get()}triton_{secrets.token_hex(4)}_"
    )
    _log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=60))
    # Kept apart from the tail: a long traceback pushes them out of it.
    _causes: dict[str, None] = field(default_factory=dict)
    _log_thread: threading.Thread | None = None
    # Set when a stopping tritonserver has finished its in-flight inferences.
    _drained: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def log_tail(self) -> str:
        return "\n".join(self._log_tail)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        install = TritonInstall.find()
        cfg = self.config
        ports = (cfg.http_port, cfg.grpc_port, cfg.metrics_port)
        if taken := listened_on(cfg.host, ports):
            # Readiness is asked over HTTP: another server on these ports would
            # answer for a tritonserver that then fails to bind and exits.
            raise TritonError(
                f"port(s) {', '.join(map(str, taken))} on {cfg.host} are in use "
                "(another tritonserver?): give Triton free ports"
            )
        self._workdir = Path(tempfile.mkdtemp(prefix="epd-triton-"))
        backends = self._prepare_backends(install, self._workdir)
        cmd = self._command(install, backends)
        env = self._environment(install)
        logger.info("starting tritonserver (grpc %s, http %s)", cfg.grpc_url, cfg.http_url)
        self._process = subprocess.Popen(
            die_with_parent(cmd),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._log_thread = threading.Thread(target=self._forward_log, daemon=True)
        self._log_thread.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _command(self, install: TritonInstall, backends: Path) -> list[str]:
        """tritonserver's command line: this model only, on this host's ports."""
        cfg = self.config
        cmd = [
            str(install.binary),
            f"--model-repository={cfg.model_repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            f"--load-model={cfg.model_name}",
            f"--http-address={cfg.host}",
            f"--grpc-address={cfg.host}",
            f"--metrics-address={cfg.host}",
            f"--http-port={cfg.http_port}",
            f"--grpc-port={cfg.grpc_port}",
            f"--metrics-port={cfg.metrics_port}",
            "--exit-on-error=true",
            "--strict-readiness=true",
            # The configs are complete; auto-completing them would start a Python
            # stub (importing torch and model.py) only to ask it for the config:
            # ~3 s of start-up before the model's own stub starts.
            "--disable-auto-complete-config",
            # The encoders' keepalive pings (services/runtime/grpc_server.py): accepted,
            # so that a frozen Triton is noticed in seconds.
            *TRITON_KEEPALIVE_FLAGS,
            f"--log-verbose={cfg.log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}",
            # The backend's stub exchange region grows by this much at a time
            # (1 MiB by default: hundreds of remaps for one large batch).
            f"--backend-config=python,shm-growth-byte-size={64 * 1024 * 1024}",
        ]
        if cfg.model_config_name:
            cmd.append(f"--model-config-name={cfg.model_config_name}")
        if cfg.otlp_endpoint:
            cmd += _tracing_flags(cfg.otlp_endpoint)
        return cmd

    def _environment(self, install: TritonInstall) -> dict[str, str]:
        """Its environment: the wheel's libraries, and what model.py reads."""
        cfg = self.config
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(install.libs), _python_library_dir(), env.get("LD_LIBRARY_PATH")])
        )
        env["EPD_VIT_CHECKPOINT"] = str(Path(cfg.checkpoint).resolve())
        env["EPD_VIT_DTYPE"] = cfg.dtype
        env["EPD_SITE_PACKAGES"] = os.pathsep.join(site.getsitepackages())
        return env

    def _prepare_backends(self, install: TritonInstall, workdir: Path) -> Path:
        """A backend folder holding the wheel's Python backend plus the stub for this Python."""
        python = workdir / "backends" / "python"
        python.mkdir(parents=True)
        for item in install.python_backend.iterdir():
            if item.is_file():
                (python / item.name).symlink_to(item)
        shutil.copy2(install.stub, python / install.stub.name)
        return python.parent

    def _forward_log(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for raw in self._process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self._log_tail.append(line)
            if (match := _CAUSE.search(line)) is not None:
                self._causes[match["cause"]] = None
            if _DRAINED in line:
                self._drained.set()
            logger.debug("tritonserver: %s", line)

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.config.http_url + path, timeout=2) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, OSError):
            return 0

    def wait_ready(self) -> None:
        """Returns once the server and the model are ready; raises with the log tail otherwise."""
        assert self._process is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        model_path = f"/v2/models/{self.config.model_name}/ready"
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                time.sleep(0.2)  # let the log thread drain
                raise TritonError(
                    f"tritonserver exited with code {code} before it was ready:\n"
                    f"{self._failure_summary()}"
                )
            if self._get("/v2/health/ready") == 200 and self._get(model_path) == 200:
                logger.info("tritonserver ready, model %r loaded", self.config.model_name)
                return
            time.sleep(0.25)
        raise TritonError(
            f"tritonserver not ready after {self.config.startup_timeout_s:.0f}s:\n"
            f"{self._failure_summary()}"
        )

    def _failure_summary(self) -> str:
        """The cause first (e.g. the model's ImportError), then the log lines around it."""
        errors = [
            line
            for line in self._log_tail
            if line.startswith("E") or "failed to load" in line or "Error" in line
        ]
        details = "\n".join(errors[-12:] or list(self._log_tail)[-20:])
        if not self._causes:
            return details
        return "".join(f"cause: {cause}\n" for cause in self._causes) + details

    def statistics(self) -> dict[str, object]:
        """Triton's per-model inference statistics (execution and inference counts)."""
        url = f"{self.config.http_url}/v2/models/{self.config.model_name}/stats"
        with urllib.request.urlopen(url, timeout=5) as reply:
            stats: dict[str, object] = json.loads(reply.read())["model_stats"][0]
            return stats

    def stop(self, timeout_s: float = 15.0) -> None:
        """Asks tritonserver to stop and waits until its in-flight inferences are
        done (or timeout_s); then kills what is left: unloading the model, which
        tritonserver would take seconds over, frees nothing a stopped process
        still holds (its shared memory is swept here)."""
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while process.poll() is None and not self._drained.is_set():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
            # Whatever is left of its group: the Python backend's stubs outlive a
            # tritonserver that was killed, holding their memory.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if self._log_thread is not None:
            self._log_thread.join(timeout=2)
        remove_segments(self._shm_prefix)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
