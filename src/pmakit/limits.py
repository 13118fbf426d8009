"""The limits pmakit puts on what it reads: far above any real checkpoint, run or config, low enough that no file
can exhaust the machine's memory or hang a merge. One table; every refusal names its limit.

A leaf module (standard library only): formats, layouts, config and the studies all read through it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError


@dataclass(frozen=True)
class Limit:
    """One bound on an input."""

    name: str
    """How errors name it."""
    value: int
    bounds: str
    """What it bounds, for the documentation table."""


MIB = 1 << 20
DCP_METADATA_BYTES = Limit("dcp-metadata-bytes", 1024 * MIB, "a DCP .metadata file (a 70B model's: ~10 MiB)")
PICKLE_RECORD_BYTES = Limit(
    "pickle-record-bytes", 64 * MIB, "the pickle of one .distcp record or common state"
)
JSON_BYTES = Limit(
    "json-bytes", 256 * MIB, "a metadata JSON file (pmakit.json, index files, trainer_state.json)"
)
JSON_DEPTH = Limit("json-depth", 64, "nesting of a metadata JSON document or JSONL line")
SAFETENSORS_HEADER_BYTES = Limit(
    "safetensors-header-bytes", 100 * MIB, "a safetensors header (safetensors' own limit is 100 MB)"
)
TENSORS_PER_FILE = Limit(
    "tensors-per-file", 200_000, "tensors in one weights file or index (a 405B model has ~2,000)"
)

RESULTS_BYTES = Limit("results-bytes", 256 * MIB, "a results file read by pmakit scaling-fit (CSV or JSONL)")
SCALING_POINTS = Limit(
    "scaling-points", 10_000, "merge and anneal points of one scaling-fit (10 sizes x 20 budgets: 400)"
)
BOOTSTRAP_RESAMPLES = Limit(
    "bootstrap-resamples",
    100_000,
    "bootstrap resamples of a ranking or a study's intervals (1,000 is the default)",
)
CONFIG_BYTES = Limit("config-bytes", 16 * MIB, "a YAML or TOML config file")
CONFIG_NODES = Limit(
    "config-nodes", 100_000, "values in a config file once its YAML aliases are expanded (a preset has ~100)"
)

REMOTE_OBJECTS = Limit(
    "remote-objects", 100_000, "objects listed under one s3:// or gs:// URL (point it at fewer snapshots)"
)
REMOTE_LIST_PAGES = Limit(
    "remote-list-pages", 500, "pages of one listing (S3 and GCS send 1,000 objects a page)"
)
REMOTE_FILE_BYTES = Limit(
    "remote-file-bytes",
    64 * MIB,
    "a non-weight object fetched into a remote run's mirror (larger ones, logs or event files, are left out; "
    "DCP .metadata files have their own limit)",
)
REMOTE_FETCH_BYTES = Limit(
    "remote-fetch-bytes", 4096 * MIB, "all non-weight objects fetched into one remote run's mirror"
)
REMOTE_KEY_DEPTH = Limit(
    "remote-key-depth",
    64,
    "folder levels of an object key below the URL (deeper keys are left out of the mirror)",
)
REMOTE_GET_SECONDS = Limit(
    "remote-get-seconds",
    300,
    "one GET's whole response, not each read of it (then retried; PMAKIT_GET_SECONDS sets another deadline)",
)

TABLE: tuple[Limit, ...] = (
    DCP_METADATA_BYTES,
    PICKLE_RECORD_BYTES,
    JSON_BYTES,
    JSON_DEPTH,
    SAFETENSORS_HEADER_BYTES,
    TENSORS_PER_FILE,
    RESULTS_BYTES,
    SCALING_POINTS,
    BOOTSTRAP_RESAMPLES,
    CONFIG_BYTES,
    CONFIG_NODES,
    REMOTE_OBJECTS,
    REMOTE_LIST_PAGES,
    REMOTE_FILE_BYTES,
    REMOTE_FETCH_BYTES,
    REMOTE_KEY_DEPTH,
    REMOTE_GET_SECONDS,
)


def refuse(limit: Limit, what: str) -> PmakitError:
    """The one-line error for an input over ``limit``."""
    return PmakitError(f"{what} is over pmakit's limit {limit.name} = {limit.value:,} ({limit.bounds})")


def read_regular(path: Path, limit: Limit) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. A FIFO, device or directory is refused without
    blocking on it (opened non-blocking, then checked), and so is a file over the limit, before it is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise PmakitError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PmakitError(f"{path}: not a regular file")
        if st.st_size > limit.value:
            raise refuse(limit, f"{path} ({st.st_size:,} bytes)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit.value + 1)
    except OSError as e:
        raise PmakitError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > limit.value:
        raise refuse(limit, str(path))
    return data


def check_regular(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file (a FIFO would block the reader forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise PmakitError(f"{path}: cannot open ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise PmakitError(f"{path}: not a regular file")


def json_depth_ok(value: Any, limit: int = JSON_DEPTH.value) -> bool:
    """Whether a parsed JSON value nests at most ``limit`` levels (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return True


def loads_json(text: str | bytes, what: str) -> Any:
    """A JSON document of bounded nesting (``JSON_DEPTH``), as one ``PmakitError`` when it is not one."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PmakitError(f"{what}: not UTF-8 text ({e.reason})") from None
    try:
        value = json.loads(text)
    except RecursionError:  # the C parser stops itself at the interpreter's recursion limit
        raise refuse(JSON_DEPTH, what) from None
    except ValueError as e:
        raise PmakitError(f"{what}: not valid JSON ({str(e).splitlines()[0][:200]})") from None
    if not json_depth_ok(value):
        raise refuse(JSON_DEPTH, what)
    return value


def read_json(path: Path) -> Any:
    """A JSON file, bounded in size and nesting, never blocking on a FIFO."""
    return loads_json(read_regular(path, JSON_BYTES), str(path))
