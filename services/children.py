"""Child processes that end when their parent does, however it ends.

A supervisor killed with SIGKILL runs no cleanup; Linux's parent-death signal
makes the kernel send SIGTERM to its children instead, so no tritonserver or
service is left running on its own.

The signal is set by util-linux's `setpriv` in front of the command, not by a
`preexec_fn`: a `preexec_fn` makes Python fork() the whole process, and forking
a process whose gRPC threads are busy runs gRPC's fork handlers in the child,
which then crashes before it can exec (1 child in 5 with a busy channel). Without
one Python uses vfork(), which runs no fork handlers at all.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv`, run so that the kernel SIGTERMs it when the process that started
    it dies (the signal survives exec: wrappers such as `ip netns exec` keep it)."""
    if sys.platform.startswith("linux") and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "TERM", "--", *argv]
    return list(argv)
