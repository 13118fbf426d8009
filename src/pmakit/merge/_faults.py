"""Fault injection for the merge's resume tests, kept off the package's public face.

A merge dies like a ``kill -9`` at a chosen point when ``PMAKIT_TEST_KILL`` says so, so that the tests (which run
the real ``pmakit merge`` in a subprocess, under torchrun too) can resume from there. Unset, it does nothing.
"""

from __future__ import annotations

import os
import signal
import time

KILL_ENV = "PMAKIT_TEST_KILL"
"""Test hook: ``after-shard:K``, ``in-shard:K`` or ``before-rename`` makes the process SIGKILL itself there
(``PMAKIT_TEST_KILL_SIGNAL=TERM``: SIGTERM, what torchrun sends the other ranks when one dies)."""


class Killer:
    """The ``PMAKIT_TEST_KILL`` hook: dies like a kill -9 at a chosen point, so that tests can resume from it."""

    def __init__(self) -> None:
        point, _, k = os.environ.get(KILL_ENV, "").partition(":")
        self.point, self.k, self.shards = point, int(k or 0), 0
        self.signal = getattr(signal, "SIG" + os.environ.get(KILL_ENV + "_SIGNAL", "KILL"))

    def at(self, point: str) -> None:
        if point == self.point and (point == "before-rename" or self.shards == self.k):
            os.kill(os.getpid(), self.signal)
            time.sleep(5)  # the signal's handler (SIGTERM) runs in the main thread, not necessarily this one
