"""Object storage (``s3://``, ``gs://``) as one face of the library: every path argument of the API takes a local
path or a URL.

- ``registry``: the schemes and their clients (``s3``: boto3, ``gs``: google-cloud-storage, imported on first use:
  a merge of local files never loads them); ``base``: the client interface, retries and deadlines.
- ``mirror``: a remote run or snapshot as a local folder (``localize``) that discovery and the layouts read as
  they read any folder, its weight files placeholders.
- ``source``: the bytes a reader reads (``open_source``): one map of a local file, ranged GETs of a remote one.
- ``publish``: a merge into a URL, staged locally and published, manifest last, under the rules of a folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from pmakit.storage.mirror import input_urls, localize, origin
from pmakit.storage.registry import is_remote, parse, store
from pmakit.storage.source import ByteSource, open_source

__all__ = [
    "ByteSource",
    "input_urls",
    "is_remote",
    "local",
    "local_all",
    "localize",
    "open_source",
    "origin",
    "parse",
    "store",
]


def local(location: str | os.PathLike[str]) -> Path:
    """A path or URL given to the API as a local path: a URL mirrored (``localize``), a path as it is."""
    return localize(location) if isinstance(location, str) and is_remote(location) else Path(location)


def local_all(locations: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """``local`` of each."""
    return [local(x) for x in locations]


def canonical(location: str | os.PathLike[str]) -> str:
    """What names a path or URL given to the API, to compare with ``origin`` of a mirrored path: a URL without a
    trailing slash, a path resolved."""
    if isinstance(location, str) and is_remote(location):
        return location.rstrip("/")
    return str(Path(location).resolve())
