"""The peak resident memory of a command run from a big process (a pytest worker, a benchmark that built tensors).

The parent cannot take it from ``wait4`` itself: a child's ``ru_maxrss`` starts from its parent's RSS at the fork
(the kernel carries the old address space's high-water mark through exec), so a 1.8 GiB pytest worker reads
1.8 GiB for every child it starts. A small launcher (a bare interpreter, ~10 MiB) becomes the command's parent,
waits for it and writes its ``ru_maxrss``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_LAUNCH = """
import os, sys
pid = os.spawnv(os.P_NOWAIT, sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def measured(command: list[str], rss_file: Path) -> list[str]:
    """``command`` run through the launcher, which writes its peak RSS in KiB to ``rss_file`` when it ends.
    ``command[0]`` must be a path (``sys.executable``), not a name looked up on PATH."""
    return [sys.executable, "-c", _LAUNCH, str(rss_file), *command]


def peak_bytes(rss_file: Path) -> int:
    """The peak RSS the launcher wrote, in bytes (0 if the command was killed before it ended)."""
    return int(rss_file.read_text()) * 1024 if rss_file.exists() else 0
