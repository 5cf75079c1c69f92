"""POSIX shared-memory segments for embedding pools.

The owner creates a segment with a random name and mode 0600 and unlinks it on
close; Python's resource tracker unlinks it too if the owner dies. Another
process attaches by name and must not unlink it, so attaching unregisters the
segment from that process's resource tracker.
"""

from __future__ import annotations

import contextlib
import secrets
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import TYPE_CHECKING

from services.runtime import env

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
_created_here: set[str] = set()  # segment names this process owns


class SharedSegment:
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner

    @classmethod
    def create(cls, size: int, kind: str = "pool") -> SharedSegment:
        name = f"{env.SHM_PREFIX.get()}{kind}_{secrets.token_hex(8)}"
        segment = cls(shared_memory.SharedMemory(name=name, create=True, size=size), owner=True)
        _created_here.add(segment.name)
        return segment

    @classmethod
    def attach(cls, name: str) -> SharedSegment:
        shm = shared_memory.SharedMemory(name=name)
        # Python 3.11 registers attached segments too, and its tracker would
        # unlink the owner's segment when this process exits. (When the owner
        # is this very process, the registration is the owner's: keep it.)
        if name not in _created_here:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def size(self) -> int:
        return self._shm.size

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor viewing the segment; drop every such view before close()."""
        import torch  # here: the launchers import this module and need no torch

        count = 1
        for dim in shape:
            count *= dim
        return torch.frombuffer(self._shm.buf, dtype=dtype, count=count).view(shape)

    def close(self) -> None:
        self._shm.close()
        if self.owner:
            _created_here.discard(self.name)
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


def remove_segments(prefix: str) -> list[str]:
    """Unlinks every segment whose name starts with prefix (what a crashed
    process left behind); returns the names removed."""
    removed = []
    for path in SHM_DIR.glob(prefix + "*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed
