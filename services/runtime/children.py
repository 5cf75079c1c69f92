"""Child processes that end when their parent does, however it ends.

A supervisor killed with SIGKILL runs no cleanup; Linux's parent-death signal
makes the kernel send SIGTERM to its children instead, so no tritonserver or
service is left running on its own.

The signal is set by a small Python program the child runs first, which then
becomes the command (exec keeps the signal), not by a `preexec_fn`: that makes
Python fork() the whole process, and forking a process whose gRPC threads are
busy runs gRPC's fork handlers in the child, which then crashes before it can
exec (1 child in 5 with a busy channel). Without one Python uses vfork(). The
program also checks that its parent is still the one that started it: a parent
that died before the signal was set would otherwise leave it running
(util-linux's `setpriv --pdeathsig` has that gap).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# argv: [expected parent pid, command...]; -I -S: nothing imported but what it names
_BECOME = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("the parent died before its child started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv`, run so that the kernel SIGTERMs it when the process that started
    it dies (wrappers that exec, such as `ip netns exec`, keep the signal)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _BECOME, str(os.getpid()), *argv]
