"""A merge into object storage (``s3://``, ``gs://``): the rules of a folder output, then the planned merge written
into a private staging folder, then the publish (``pmakit.storage.publish``: the manifest last).

``merge(..., out="s3://...")`` and ``execute(plan, "s3://...")`` come here. The output may not be, lie inside or
contain an input (the snapshots and the runs they were mirrored from); a finished merge there is replaced only with
``force``, anything pmakit did not write only with ``force``, and ``force`` leaves exactly the new merge under the
prefix. The staging merge is the local merge of the same plan with the same options, its device included; a rerun
with ``resume`` continues whichever step was cut: the merge through its ledger, the publish by the objects' sha256.
This module is the merge's side of publishing; ``pmakit.storage`` knows nothing of merges.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError, redact
from pmakit.guard import output_lock
from pmakit.layouts.base import MERGE_MANIFEST
from pmakit.merge.plan import MergePlan, MergeResult
from pmakit.storage import mirror, publish
from pmakit.storage.registry import is_remote

LOCAL_ONLY = "fp32 sums, incremental updates and several ranks merge into folders only"


def check_url_output(
    url: str,
    *,
    force: bool = False,
    resume: bool = False,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> str:
    """Fail before merging, not after: a malformed or overlapping output URL (``inputs``: URLs or local paths, the
    mirrors of remote inputs included), a missing bucket, bad credentials, a finished merge or foreign objects
    under the prefix without ``force``. Returns the URL as the merge writes it (normalised)."""
    items = list(inputs)
    urls = [x for x in items if isinstance(x, str) and is_remote(x)]
    urls += mirror.input_urls(Path(x) for x in items if not (isinstance(x, str) and is_remote(x)))
    return publish.check_output(url, MERGE_MANIFEST, force, resume, urls).url


def merge_to_url(
    plan: MergePlan,
    out: str,
    *,
    force: bool,
    resume: bool,
    manifest_extra: dict[str, Any] | None,
    out_format: str | None,
    write: Callable[[Path, bool, dict[str, Any]], MergeResult],
) -> MergeResult:
    """``plan`` written into a private staging folder by ``write(folder, force, manifest_extra)`` (the local
    merge), then published at ``out``."""
    paths = [s.path for s in plan.snapshots]
    url = check_url_output(out, force=force, resume=resume, inputs=paths)
    extra = {**(manifest_extra or {}), "output_url": redact(url)}
    # What the merge writes (its staging folder is found again by a rerun of the same merge, whatever else)
    keyed = [plan.weights, str(plan.dtype), plan.max_shard_size, plan.buffers, str(out_format)]
    folder = publish.staging_dir(
        url, json.dumps([[mirror.origin(p) for p in paths], keyed, extra], default=str)
    )
    staged = folder / publish.STAGED
    # One merge into this staging folder at a time, its publish included.
    with output_lock(folder / "publish"):
        if resume and (staged / MERGE_MANIFEST).is_file():  # merged already; the upload was cut
            result = MergeResult(staged, plan, 0.0, json.loads((staged / MERGE_MANIFEST).read_text()))
        else:  # an interrupted staging merge is continued as a folder's is, unless forced; a finished one replaced
            result = write(staged, force or staged.exists(), extra)
        publish.publish(staged, url, MERGE_MANIFEST, resume)
    publish.remove_staging(folder)
    return dataclasses.replace(result, url=url)


def refuse_local_only(out: str, keep_fp32: bool, incremental: bool, ranks: int) -> None:
    """What merges into folders only (the fp32 sums and an incremental update read a folder back; several ranks
    write one folder) refused for a URL, before any work."""
    if keep_fp32 or incremental or ranks > 1:
        raise PmakitError(f"{out}: {LOCAL_ONLY}")
