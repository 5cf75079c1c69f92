"""Child processes that end when their parent does, however it ends.

A supervisor killed with SIGKILL runs no cleanup; Linux's parent-death signal
makes the kernel send SIGTERM to its children instead, so no tritonserver or
service is left running on its own.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For subprocess.Popen(preexec_fn=...): SIGTERM this child when the parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
