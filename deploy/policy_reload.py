"""Hot swap of the Feather policy file: pick up a new version between engine steps, or refuse it.

:class:`PolicyReloader` looks at the policy file at most once per ``interval_s`` (one
``time.monotonic()`` call per step otherwise; one ``os.stat`` per look). When the file's
signature (modification time, size, inode) differs from the one last seen, it loads the file
with ``load`` (the scheduler's :func:`deploy.scheduler.load_deployable_policy`, which checks the
observation contract) and hands the new policy back; the caller swaps it in before the next
admission scan, so every step is decided by one policy from start to end. A file that does
not load (corrupt, incompatible, half-written) is refused with a warning and the old policy
keeps deciding; the refused signature is remembered, so the same bad file is tried once, and a
later write (new signature) is tried again. A file that vanishes is ignored until it returns.

Writers should replace the file atomically (write a temporary file, then ``os.replace``);
a half-written file is only refused, never served. Loading runs in the engine thread: the step
after a change waits for it (an ONNX session, tens of milliseconds).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


class PolicyReloader:
    """Watches ``path``; :meth:`poll` returns a newly loaded policy, or None (see module doc).

    The signature at construction is taken as the one already loaded. ``version`` counts the
    swaps (0: the policy of the start); ``refusals`` the files refused.
    """

    def __init__(self, path: str | os.PathLike, load: Callable[[str], object], *, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s >= 0:
            raise ValueError(f"policy reload interval must be >= 0 s, got {interval_s}")
        self.path = Path(path)
        self.interval_s = float(interval_s)
        self.version = 0
        self.refusals = 0
        self._load = load
        self._clock = clock
        self._seen = self._signature()
        self._next_look = clock() + self.interval_s

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    def poll(self):
        """The new policy when the file changed and loads; None otherwise (nothing to swap)."""
        now = self._clock()
        if now < self._next_look:
            return None
        self._next_look = now + self.interval_s
        signature = self._signature()
        if signature is None or signature == self._seen:
            return None
        self._seen = signature
        try:
            policy = self._load(str(self.path))
        except (OSError, ValueError) as exc:
            self.refusals += 1
            logger.warning("Feather policy %s changed but is refused (%s); the previous policy keeps serving",
                           self.path, exc)
            return None
        self.version += 1
        logger.info("Feather policy %s reloaded (version %d)", self.path, self.version)
        return policy

    def describe(self) -> dict:
        return {"policy_version": self.version, "policy_refusals": self.refusals}
