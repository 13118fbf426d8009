"""A merge into object storage (``s3://``, ``gs://``): the rules of a folder output, then the local merge in a
private staging folder, then the publish (``pmakit.storage.publish``: the manifest last).

``merge(..., out="s3://...")`` comes here (``url_outputs`` wraps it). The output may not be, lie inside or contain
an input (the snapshots and the runs they were mirrored from); a finished merge there is replaced only with
``force``, anything pmakit did not write only with ``force``, and ``force`` leaves exactly the new merge under the
prefix. The staging merge is the local merge with the same options, ``world`` (its device) included; a rerun with
``resume`` continues whichever step was cut: the merge through its ledger, the publish by the objects' sha256.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ParamSpec

from pmakit.errors import PmakitError, redact
from pmakit.guard import output_lock
from pmakit.layouts.base import MERGE_MANIFEST
from pmakit.merge.plan import MergeResult, plan_merge
from pmakit.storage import mirror, publish
from pmakit.storage.registry import is_remote

P = ParamSpec("P")
UNKEYED = ("progress", "threads", "fsync", "force", "resume", "world", "manifest_extra")
"""Arguments that do not change what a merge writes (its staging folder is found again whatever they are)."""


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


def url_outputs(merge: Callable[P, MergeResult]) -> Callable[P, MergeResult]:
    """``merge`` (the local one), taking an ``s3://`` or ``gs://`` ``out`` as well (``merge_to_url``)."""
    signature = inspect.signature(merge)

    @functools.wraps(merge)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> MergeResult:
        bound = signature.bind(*args, **kwargs)
        if not is_remote(bound.arguments["out"]):
            return merge(*args, **kwargs)
        bound.apply_defaults()
        return merge_to_url(merge, dict(bound.arguments))

    return wrapper


def merge_to_url(merge: Callable[..., MergeResult], args: dict[str, Any]) -> MergeResult:
    """The local ``merge`` with ``args`` (every argument, by name) into a private staging folder, then published
    at ``args["out"]``."""
    ranks = args["world"].size if args["world"] is not None else 1
    if args["keep_fp32"] or args["window"] is not None or ranks > 1:
        raise PmakitError(
            f"{args['out']}: fp32 sums, incremental updates and several ranks merge into folders only"
        )
    snapshots, weights = args["snapshots"], args["weights"]
    paths = [s.path for s in snapshots]
    url = check_url_output(args["out"], force=args["force"], resume=args["resume"], inputs=paths)
    extra = {**(args["manifest_extra"] or {}), "output_url": redact(url)}
    keyed = {k: str(v) for k, v in args.items() if k not in ("snapshots", "out", *UNKEYED)}
    folder = publish.staging_dir(url, json.dumps([[mirror.origin(p) for p in paths], keyed, extra]))
    staged = folder / publish.STAGED
    # One merge into this staging folder at a time, its publish included.
    with output_lock(folder / "publish"):
        if args["resume"] and (staged / MERGE_MANIFEST).is_file():  # merged already; the upload was cut
            options = {k: args[k] for k in ("dtype", "max_shard_size", "buffers")}
            plan = plan_merge(snapshots, weights, **options)
            result = MergeResult(staged, plan, 0.0, json.loads((staged / MERGE_MANIFEST).read_text()))
        else:  # an interrupted staging merge is continued as a folder's is, unless forced; a finished one replaced
            restart = args["force"] or staged.exists()
            result = merge(**{**args, "out": staged, "force": restart, "manifest_extra": extra})
        publish.publish(staged, url, MERGE_MANIFEST, args["resume"])
    publish.remove_staging(folder)
    return dataclasses.replace(result, url=url)
