"""One build at a time of a cached folder (a converted or trained model), across processes."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def build_lock(target: Path):
    """Hold an exclusive lock on ``<target>.lock`` (beside ``target``) for the block.

    Invariant: two processes that build ``target`` under this lock and check its completion
    marker inside the block build it once; the second finds it complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
