"""File checksums, shared by the merge's output and resume ledger and by object-storage uploads (a module of its
own so that ``pmakit.storage`` needs nothing of ``pmakit.merge``)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * 2**20):
            h.update(block)
    return h.hexdigest()
