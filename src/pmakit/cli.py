"""The ``pmakit`` command. Each subcommand parses options and calls the library; errors are one line."""

from __future__ import annotations

import pmakit._env  # noqa: F401  (before torch)

# isort: split

import errno
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import click

from pmakit.config import preset_names
from pmakit.errors import PmakitError, redact
from pmakit.layouts import out_formats
from pmakit.layouts.kinds import BUFFER_RULES, DEFAULT_BUFFERS, describe, listing
from pmakit.runs import checkpoint_dir
from pmakit.units import format_bytes, format_tokens, parse_size, parse_tokens
from pmakit.weights import WEIGHTINGS, uses_alpha


class _Methods(click.Choice[str]):
    """The weightings of ``pmakit.weights.WEIGHTINGS``, read when a command runs: one registered after this module
    was imported is a choice too."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(WEIGHTINGS)

    @choices.setter
    def choices(self, value: Sequence[str]) -> None:
        pass  # the registry is the list


METHODS = _Methods()


class _Group(click.Group):
    """Turns a PmakitError anywhere below into click's one-line ``Error: ...`` and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PmakitError as e:
            raise click.ClickException(str(e)) from None
        except OSError as e:
            if e.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
                raise
            # A path the system cannot resolve (longer than PATH_MAX or NAME_MAX, a symlink loop) is the user's
            # input, wherever it is first touched; the name is cut to fit one line.
            name = str(e.filename or "")
            short = name if len(name) <= 160 else f"{name[:80]}...{name[-60:]} ({len(name):,} characters)"
            raise click.ClickException(redact(f"{short}: {e.strerror}")) from None
        except Exception as e:
            _peer_failed(e)
            raise


def _peer_failed(error: Exception) -> None:
    """A process of a distributed job (a model copy of `pmakit train --replicas`, a rank of a merge) whose
    collective failed: another process failed or is gone, and says why itself. Under pmakit's own launcher the
    copy ends quietly (the launcher's line names the copy that failed first); under torchrun, one line. A
    failure of the process's own is left as it is."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("RANK")
    if world < 2 or rank is None:
        return
    from pmakit.train.launch import PEER_FAILED_EXIT, collective_failed

    if not collective_failed(error):
        return
    if os.environ.get("PMAKIT_COPIES"):
        raise SystemExit(PEER_FAILED_EXIT) from None
    raise click.ClickException(
        f"process {rank} of {world} stopped: a collective with the others failed (another one failed or is gone)"
    ) from None


class _Location(click.ParamType):
    """A local path, or an ``s3://`` / ``gs://`` URL kept as it is (``click.Path`` would fold its ``//``)."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        from pmakit.remote import is_remote

        return value if is_remote(str(value)) else Path(value)


LOCATION = _Location()


class _WarningHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        level = "warning" if record.levelno >= logging.WARNING else "info"
        click.echo(f"{level}: {redact(record.getMessage())}", err=True)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="pmakit")
def cli() -> None:
    """Pre-trained Model Averaging: merge LLM pre-training snapshots, train with snapshots, run the study."""
    logger = logging.getLogger("pmakit")
    if not any(isinstance(h, _WarningHandler) for h in logger.handlers):
        logger.addHandler(_WarningHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    # SIGTERM unwinds like Ctrl-C, so partial outputs are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _exit_quietly(*_: object) -> None:
    """SIGTERM once the command has returned (torchrun or the replica launcher stopping a copy that is already
    leaving): nothing is left to unwind, and a SystemExit raised inside an exit hook would print a traceback."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):  # a stream closed or mid-write: exiting anyway
            stream.flush()
    os._exit(143)


def _tokens(_: click.Context, __: click.Parameter, value: str | None) -> int | None:
    return None if value is None else _convert(parse_tokens, value)


def _size(_: click.Context, __: click.Parameter, value: str) -> int:
    return _convert(parse_size, value)


def _convert(fn: Callable[[str], int], value: str) -> int:
    try:
        return fn(value)
    except PmakitError as e:
        raise click.BadParameter(str(e)) from None


def _floats(_: click.Context, __: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


def selection_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--last/--every/--until/--tokens-per-step/--exclude, shared by merge and inspect."""
    options = [
        click.option(
            "--last",
            type=int,
            default=None,
            help="How many snapshots N to merge [default from a run directory: the window its own online merge used "
            "(pmakit train records it), else 10; every snapshot named].",
        ),
        click.option(
            "--every",
            callback=_tokens,
            metavar="TOKENS",
            help="Spacing V between chosen snapshots, going back from the window's end (500M, 4B, 1.5T).",
        ),
        click.option(
            "--until",
            callback=_tokens,
            metavar="TOKENS",
            help="The window ends at the newest snapshot with tokens <= TOKENS [default: the newest].",
        ),
        click.option(
            "--tokens-per-step",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per step, for snapshots without token metadata (HF checkpoint-N, step-N dirs, "
            "Lightning .ckpt files).",
        ),
        click.option(
            "--exclude",
            multiple=True,
            type=click.Path(path_type=Path),
            help="Leave this snapshot out (repeatable).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _local(locations: Sequence[Path | str]) -> list[Path]:
    """Command-line locations as local paths: object storage URLs as local mirrors (``pmakit.remote``)."""
    if not any(isinstance(x, str) for x in locations):
        return [Path(x) for x in locations]
    from pmakit.remote import localize_all

    return localize_all(locations)


def _select(
    inputs: Sequence[Path | str],
    last: int | None,
    every: int | None,
    until: int | None,
    tokens_per_step: int | None,
    exclude: Sequence[Path],
) -> list[Any]:
    from pmakit.selection import default_last, select_snapshots
    from pmakit.snapshot import gather

    snapshots, from_run = gather(_local(inputs), tokens_per_step, exclude)
    if last is None and from_run and every is None:
        last = default_last([s for s in snapshots if until is None or s.tokens <= until])
    return select_snapshots(snapshots, last=last, every=every, until=until)


@contextmanager
def _progress(total: int, quiet: bool, label: str) -> Iterator[Callable[[int], None] | None]:
    """A bytes/s progress bar on a terminal; nothing with --quiet or when stderr is not a TTY."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


@cli.command()
@click.argument("inputs", nargs=-1, required=True, type=LOCATION, metavar="RUN_DIR|SNAPSHOT|URL...")
@click.option(
    "-o",
    "--output",
    required=True,
    type=LOCATION,
    help="Output model directory, or an s3:// / gs:// URL (made locally, then uploaded; manifest last).",
)
@click.option(
    "--method",
    type=METHODS,
    default="sma",
    show_default=True,
    help="Weighting over the chosen snapshots, oldest to newest (see README for the exact formulas).",
)
@click.option(
    "--alpha",
    type=float,
    default=None,
    help="EMA factor for ema / ema-normalized (only those) [default: 0.2].",
)
@click.option(
    "--weights",
    "custom",
    callback=_floats,
    metavar="W1,W2,...",
    help="Custom weights, oldest first, one per chosen snapshot; normalised (with a warning) if their "
    "sum is not 1. Replaces --method.",
)
@selection_options
@click.option(
    "--dtype",
    type=click.Choice(["same", "bf16", "fp16", "fp32"]),
    default="same",
    show_default=True,
    help="Output dtype of float tensors (accumulation is always fp32).",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    callback=_size,
    help="Largest output shard (bytes, or with KB/MB/GB/KiB/MiB/GiB); a larger tensor gets its own.",
)
@click.option(
    "--force", is_flag=True, help="Replace OUTPUT if it exists (only once the new merge is complete)."
)
@click.option("--dry-run", is_flag=True, help="Show what would be merged and stop.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted merge (kill -9, crash) into the same OUTPUT, redoing only unfinished shards.",
)
@click.option(
    "--from-previous",
    type=click.Path(path_type=Path),
    default=None,
    metavar="MERGE_DIR",
    help="Update the sma/ema merge in MERGE_DIR to the window chosen now, reading only the snapshots that "
    "entered or left it (needs fp32 sums: MERGE_DIR made with --keep-fp32 or --dtype fp32).",
)
@click.option(
    "--keep-fp32",
    is_flag=True,
    help="Also keep the fp32 sums in OUTPUT/pmakit-fp32/ so that --from-previous can update this merge exactly.",
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["native", *out_formats()]),
    default="native",
    show_default=True,
    help="Output layout. native: the newest input's own (e.g. an OLMo-core checkpoint that trainer "
    "loads; HF safetensors for pmakit, HF and plain DCP inputs); safetensors: HF layout under the "
    "names the inputs use; dcp: torch.distributed.checkpoint, names at the top level; or a trainer's layout.",
)
@click.option(
    "--buffers",
    type=click.Choice(list(BUFFER_RULES)),
    default=DEFAULT_BUFFERS,
    show_default=True,
    help="MoE routers' load-balancing biases (expert_bias, score_bias, e_score_correction_bias): averaged like "
    "the weights, or the newest snapshot's; written in fp32 either way. Counters (tokens per expert) are "
    "always the newest's. See docs/moe.md.",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where to accumulate; under torchrun, cuda uses NCCL and cpu uses gloo.",
)
def merge(device: str, quiet: bool, **options: Any) -> None:
    """Average snapshots chosen by tokens into a model directory (HF safetensors layout).

    A RUN_DIR is a folder of snapshot directories (default: its last 10); SNAPSHOTs named one by one are all used.
    Under `torchrun --nproc-per-node K -m pmakit merge ...` the K ranks share the work.
    """
    from pmakit.world import init_from_env, shutdown

    world = init_from_env(device)
    try:
        _merge(**options, quiet=quiet or world.rank != 0, world=world)
    finally:
        shutdown(world)


def _merge(
    inputs: tuple[Path | str, ...],
    output: Path | str,
    method: str,
    alpha: float | None,
    custom: list[float] | None,
    last: int | None,
    every: int | None,
    until: int | None,
    tokens_per_step: int | None,
    exclude: tuple[Path, ...],
    dtype: str,
    max_shard_size: int,
    force: bool,
    dry_run: bool,
    quiet: bool,
    resume: bool,
    from_previous: Path | None,
    keep_fp32: bool,
    out_format: str,
    buffers: str,
    world: Any,
) -> None:
    from pmakit.merge import merge as run_merge
    from pmakit.weights import get_weights

    if alpha is not None and (custom is not None or not uses_alpha(method)):
        raise PmakitError(
            f"--alpha is the EMA factor: it does nothing with --{'weights' if custom else 'method ' + method}"
        )
    alpha = 0.2 if alpha is None else alpha
    if isinstance(output, str):
        output = _check_url_output(
            output, inputs, from_previous is not None or keep_fp32, world, force, resume
        )
    chosen = _select(inputs, last, every, until, tokens_per_step, exclude)
    weights = get_weights("custom" if custom is not None else method, len(chosen), alpha=alpha, custom=custom)
    terms, term_weights, window = chosen, weights, None
    extra: dict[str, Any] = {}
    if from_previous is not None:
        terms, term_weights, window, extra["incremental"] = _incremental(
            from_previous, chosen, weights, method, alpha, custom, quiet, buffers
        )
        keep_fp32 = True
    plan = _plan(terms, term_weights, dtype, max_shard_size, world, window, buffers)
    if (dry_run and world.rank == 0) or not quiet:
        _print_plan(plan, incremental=window is not None)
    if dry_run:
        return
    extra.update(_merge_record(inputs, method, alpha, custom, last, every, until))
    with _progress(_rank_input_bytes(plan, world.rank), quiet, "merging") as progress:
        result = run_merge(
            terms,
            term_weights,
            output,
            dtype=dtype,
            max_shard_size=max_shard_size,
            force=force,
            progress=progress,
            manifest_extra=extra,
            resume=resume,
            out_format=None if out_format == "native" else out_format,
            keep_fp32=keep_fp32,
            world=world,
            window=window,
            buffers=buffers,
        )
    if keep_fp32 and from_previous is None and not Path(output, "pmakit-fp32").is_dir() and world.rank == 0:
        click.echo(
            f"note: no {Path(output, 'pmakit-fp32')}: the merge is fp32 already, so --from-previous {output} "
            "updates it exactly as it is",
            err=True,
        )
    if not quiet:
        _print_result(plan, result, output)
        if result.url is not None:
            click.echo(f"published {result.url}")


def _check_url_output(
    url: str, inputs: Sequence[Path | str], local_only: bool, world: Any, force: bool, resume: bool
) -> str:
    """Fail before merging, not after, on an output URL the library refuses (overlapping an input, a missing bucket,
    bad credentials, a finished merge or foreign objects there) or an option that only merges into a local folder
    (``local_only``). Returns the URL as the merge writes it."""
    from pmakit.merge.url import check_url_output

    if local_only or world.size > 1:
        raise PmakitError(f"{url}: --from-previous, --keep-fp32 and torchrun merge into local folders only")
    return check_url_output(url, force=force, resume=resume, inputs=inputs)


def _incremental(
    from_previous: Path,
    chosen: list[Any],
    weights: list[float],
    method: str,
    alpha: float,
    custom: list[float] | None,
    quiet: bool,
    buffers: str,
) -> tuple[list[Any], list[float], tuple[list[Any], list[float]], dict[str, Any]]:
    """The terms, weights, window and manifest record of a --from-previous update of an earlier merge."""
    from pmakit.merge import plan_increment

    if custom is not None:
        raise PmakitError("--from-previous updates sma/ema merges; custom --weights need a full merge")
    inc = plan_increment(from_previous, chosen, weights, method=method, alpha=alpha, buffers=buffers)
    if not quiet:
        click.echo(f"incremental update of {from_previous}: {inc.reads} reads instead of {len(chosen)}")
    return inc.terms, inc.weights, (chosen, weights), inc.record(from_previous)


def _plan(
    terms: list[Any],
    term_weights: list[float],
    dtype: str,
    max_shard_size: int,
    world: Any,
    window: Any,
    buffers: str,
) -> Any:
    """The shard plan over the world's ranks; an incremental update's terms in the full merge's dtypes."""
    from pmakit.merge import plan_merge
    from pmakit.merge.plan import window_dtypes

    return plan_merge(
        terms,
        term_weights,
        dtype=window_dtypes(dtype, window[0] if window else None, buffers),
        max_shard_size=max_shard_size,
        ranks=world.size,
        buffers=buffers,
    )


def _merge_record(
    inputs: tuple[Path | str, ...],
    method: str,
    alpha: float,
    custom: list[float] | None,
    last: int | None,
    every: int | None,
    until: int | None,
) -> dict[str, Any]:
    """How the snapshots were chosen and weighted, for the output's manifest."""
    return {
        "method": "custom" if custom is not None else method,
        "alpha": alpha,
        "selection": {"last": last, "every": every, "until": until, "inputs": [str(p) for p in inputs]},
    }


def _rank_input_bytes(plan: Any, rank: int) -> int:
    """Bytes this rank reads: the inputs of the shards it owns (its progress bar's total)."""
    return sum(plan.shard_input_bytes(i) for i in range(len(plan.shards)) if plan.owner(i) == rank)


def _print_result(plan: Any, result: Any, output: Path | str) -> None:
    rate = plan.input_bytes / max(result.seconds, 1e-9)
    click.echo(
        f"wrote {output} ({format_bytes(plan.output_bytes)} in {len(plan.shards)} file(s)) in "
        f"{result.seconds:.1f} s, reading {format_bytes(rate)}/s"
    )


def _print_plan(plan: Any, incremental: bool = False) -> None:
    from pmakit.remote import origin

    for snap, w in zip(plan.snapshots, plan.weights):
        step = "" if snap.step is None else f"step {snap.step:>8}  "
        click.echo(f"  {w:8.5f}  {step}{format_tokens(snap.tokens):>8} tokens  {origin(snap.path)}")
    click.echo(
        f"{len(plan.snapshots)} snapshots, {len(plan.tensors)} tensors: reads "
        f"{format_bytes(plan.input_bytes)}, writes {format_bytes(plan.output_bytes)} in "
        f"{len(plan.shards)} file(s), work memory {format_bytes(plan.peak_memory)} "
        f"({plan.fold.workers} fold worker(s): {plan.fold.why})"
    )
    _print_state(listing(plan.kinds, plan.buffers))
    if plan.precisions and not incremental:  # an update's terms mix the fp32 sums with snapshots
        click.echo(f"precision: {plan.precision()['why']}")


def _print_state(state: dict[str, Any]) -> None:
    """One line per kind of non-weight state (router biases, counters): how many, the rule, a few names."""
    for line in describe(state):
        click.echo(line)


@cli.command()
@click.argument("inputs", nargs=-1, type=LOCATION, metavar="RUN_DIR|SNAPSHOT|URL...")
@selection_options
@click.option(
    "--dtype",
    type=click.Choice(["same", "bf16", "fp16", "fp32"]),
    default="same",
    help="Output dtype assumed for the merge estimate.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option(
    "--all", "show_all", is_flag=True, help="List every snapshot, not only the default merge's window."
)
@click.option("--plan", is_flag=True, help="Plan a merge at scale: memory per rank, bytes, expected time.")
@click.option(
    "--layout",
    type=click.Path(path_type=Path),
    default=None,
    help="With --plan: a JSON file of tensor names -> shapes/dtypes instead of snapshots.",
)
@click.option("--snapshots", type=int, default=10, show_default=True, help="With --layout: inputs to merge.")
@click.option("--ranks", type=int, default=1, show_default=True, help="With --plan: ranks sharing the merge.")
@click.option(
    "--nodes", type=int, default=1, show_default=True, help="With --plan: machines (disks) they run on."
)
@click.option(
    "--disk-bandwidth",
    callback=lambda c, p, v: None if v is None else _size(c, p, v),
    default=None,
    metavar="BYTES",
    help="With --plan: a node's disk read/write bytes per second (e.g. 2GB) [default: measured here].",
)
@click.option(
    "--accumulate-bandwidth",
    callback=lambda c, p, v: None if v is None else _size(c, p, v),
    default=None,
    metavar="BYTES",
    help="With --plan: input bytes per second one rank accumulates [default: measured here].",
)
def inspect(
    inputs: tuple[Path | str, ...],
    last: int | None,
    every: int | None,
    until: int | None,
    tokens_per_step: int | None,
    exclude: tuple[Path, ...],
    dtype: str,
    as_json: bool,
    show_all: bool,
    plan: bool,
    layout: Path | None,
    snapshots: int,
    ranks: int,
    nodes: int,
    disk_bandwidth: int | None,
    accumulate_bandwidth: int | None,
) -> None:
    """Table of snapshots (with the run layout that recognised each), their compatibility, and what a merge of
    them would need. Exits non-zero when nothing is mergeable."""
    from pmakit.survey import inspect_inputs, render

    if plan or layout is not None:
        from pmakit.merge.capacity import plan_report, render_plan

        chosen = (
            _select(inputs, last, every, until, tokens_per_step, exclude)
            if layout is None and inputs
            else None
        )
        if layout is None and not chosen:
            raise PmakitError("--plan needs snapshots or a --layout file")
        scale = plan_report(
            chosen,
            layout,
            snapshots=snapshots,
            ranks=ranks,
            nodes=nodes,
            dtype=dtype,
            disk_bandwidth=disk_bandwidth,
            accumulate_bandwidth=accumulate_bandwidth,
        )
        click.echo(json.dumps(scale, indent=2) if as_json else render_plan(scale))
        return
    if not inputs:
        raise PmakitError("name a run directory or snapshots to inspect")
    report = inspect_inputs(
        _local(inputs),
        last=last,
        every=every,
        until=until,
        tokens_per_step=tokens_per_step,
        exclude=exclude,
        dtype=dtype,
    )
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render(report, show_all=show_all)
    if not report["compatible"]:  # scripts can test the exit code: nothing here can be merged
        raise PmakitError(f"nothing to merge: {'; '.join(report['problems'])}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Output snapshot directory."
)
@click.option(
    "--before",
    callback=_tokens,
    metavar="TOKENS",
    help="Merge only snapshots with tokens strictly below TOKENS (where the spike began) "
    "[default: find the spike in RUN_DIR/metrics.jsonl].",
)
@click.option("--last", type=int, default=3, show_default=True, help="How many snapshots K to merge.")
@click.option("--method", type=METHODS, default="sma", show_default=True, help="Weighting of the K.")
@click.option(
    "--alpha", type=float, default=0.2, show_default=True, help="EMA factor for ema / ema-normalized."
)
@click.option(
    "--optimizer",
    type=click.Choice(["reset", "keep-latest"]),
    default="reset",
    show_default=True,
    help="reset: no optimizer state (the trainer starts afresh); keep-latest: copy the optimizer state of the "
    "newest full checkpoint before the spike.",
)
@click.option(
    "--threshold",
    type=float,
    default=6.0,
    show_default=True,
    help="Spike detection: robust z (median/MAD) a training loss must exceed.",
)
@click.option(
    "--patience",
    type=int,
    default=3,
    show_default=True,
    help="Spike detection: consecutive out-of-line steps that make a spike.",
)
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def recover(
    run_dir: Path,
    output: Path,
    before: int | None,
    last: int,
    method: str,
    alpha: float,
    optimizer: str,
    threshold: float,
    patience: int,
    force: bool,
) -> None:
    """Roll a run back after a loss spike: merge its last K snapshots before the spike into a snapshot to resume."""
    from pmakit.recover import SpikeConfig
    from pmakit.recover import recover as run_recover

    result = run_recover(
        run_dir,
        out=output,
        before=before,
        last=last,
        method=method,
        alpha=alpha,
        optimizer=optimizer,
        detector=SpikeConfig(threshold=threshold, patience=patience),
        force=force,
    )
    if result.spike is not None:
        click.echo(result.spike.describe())
    click.echo(
        f"merging {len(result.snapshots)} snapshot(s) before {format_tokens(result.before_tokens)} tokens:"
    )
    for snap, w in zip(result.snapshots, result.weights):
        step = "" if snap.step is None else f"step {snap.step:>8}  "
        click.echo(f"  {w:8.5f}  {step}{format_tokens(snap.tokens):>8} tokens  {snap.path}")
    opt = "none (reset)" if result.optimizer_from is None else str(result.optimizer_from.path)
    # The training run: the folder with the checkpoint (RUN_DIR may be its snapshots/ folder).
    run = next((d for d in (run_dir, run_dir.parent) if checkpoint_dir(d).is_dir()), run_dir)
    click.echo(
        f"wrote {output} (optimizer state: {opt}); resume with: pmakit train --resume-from {output} -o {run}"
    )


@cli.command()
@click.argument("config", required=False, type=click.Path(path_type=Path))
@click.option(
    "--preset",
    type=str,
    default=None,
    help=f"A shipped config: {', '.join(preset_names())} [default: demo].",
)
@click.option(
    "--corpus", type=str, default=None, help="Text file, directory, glob or .npy/.bin of token ids."
)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Run directory.")
@click.option(
    "--resume-from",
    type=click.Path(path_type=Path),
    default=None,
    help="Continue from a full checkpoint or a `pmakit recover` output (weights and optimizer state).",
)
@click.option(
    "--init-from",
    type=click.Path(path_type=Path),
    default=None,
    help="Start from these weights (e.g. a merge) with a fresh optimizer and schedule (PMA-init).",
)
@click.option("--fresh", is_flag=True, help="Ignore the run directory's checkpoint and start over.")
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Train R model copies, one process each (started here, or under torchrun --nproc-per-node R), each on its own data shard.",
)
@click.option(
    "--sync",
    type=click.Choice(["weights", "gradients"]),
    default="weights",
    show_default=True,
    help="With --replicas: average weights every --sync-every steps (local SGD / DiLoCo), or all-reduce "
    "gradients every step (synchronous data parallel, the baseline).",
)
@click.option(
    "--sync-every",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="H: inner steps between syncs.",
)
@click.option(
    "--outer",
    type=click.Choice(["average", "sgd", "nesterov"]),
    default="average",
    show_default=True,
    help="What a sync does: average the copies (local SGD), or an outer SGD / Nesterov step on the averaged "
    "pseudo-gradient (DiLoCo).",
)
@click.option("--outer-lr", type=float, default=0.7, show_default=True, help="Outer learning rate (DiLoCo).")
@click.option("--outer-momentum", type=float, default=0.9, show_default=True, help="Outer momentum (DiLoCo).")
@click.option(
    "--save-replicas",
    is_flag=True,
    help="Also snapshot each copy's own weights before a sync (RUN/replicas/).",
)
@click.option(
    "--backend",
    type=click.Choice(["torch", "torchft"]),
    default="torch",
    show_default=True,
    help="torch: the copies are one torch.distributed job; torchft: fault tolerant, a copy that is killed is "
    "restarted and heals from a live one while the others go on (weights sync only; needs torchft).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="With --backend torchft: how many times in all a killed copy is restarted.",
)
def train(
    config: Path | None,
    preset: str | None,
    corpus: str | None,
    output: Path,
    resume_from: Path | None,
    init_from: Path | None,
    fresh: bool,
    replicas: int | None,
    **sync: Any,
) -> None:
    """Pre-train a small Llama model with a WSD schedule, snapshots every V tokens and an online merge.

    Runs resume from RUN/checkpoint after a crash or Ctrl-C: run the same command again. Without CONFIG or
    --preset, a run directory that has a checkpoint continues with the config saved in it.
    """
    from pmakit.config import load
    from pmakit.train.launch import start_copies
    from pmakit.train.loop import TrainConfig, load_corpus, saved_config, source_config
    from pmakit.train.loop import train as run_train

    saved = saved_config(output) if config is None and preset is None and not fresh else None
    weights = resume_from or init_from
    if saved is None and config is None and preset is None and weights is not None:
        # the model must be the one the weights were trained as, not the demo's
        found = source_config(weights)
        if found is not None:
            saved, where = found
            click.echo(f"config: from {where}", err=True)
    section = (
        saved if saved is not None else dict(load(config, preset, default_preset="demo").get("train", {}))
    )
    if corpus is not None:
        section["corpus"] = corpus
    cfg = TrainConfig.from_dict(section)
    copies = start_copies(cfg, replicas, lambda: load_corpus(cfg), **sync)
    if copies is None:  # the copies ran in processes of their own; rank 0 said what it trained
        return
    trainer = run_train(
        cfg,
        output,
        resume=not fresh or copies.restarted,
        resume_from=resume_from,
        init_from=init_from,
        progress=copies.is_writer,
        copies=copies,
    )
    copies.finish()
    if not copies.is_writer:
        return
    click.echo(
        f"trained {trainer.tokens:,} tokens ({trainer.step} steps); snapshots in {output / 'snapshots'}"
    )


@cli.command()
@click.argument("config", required=False, type=click.Path(path_type=Path))
@click.option(
    "--preset",
    type=str,
    default=None,
    help="A shipped study: demo (default), smoke (about a minute), spike (loss-spike recovery, paper E10), "
    "init (continued training from a merge, E9), scaling (scaling laws from merges; scaling-smoke: toy sizes), "
    "sweep (a hyper-parameter sweep ranked early by merges; sweep-smoke: toy size), replicas.",
)
@click.option(
    "--corpus",
    type=str,
    default=None,
    help="Text file, directory, glob or .npy/.bin of token ids [default: the pinned torch package's .py sources; 'stdlib': this Python's standard library].",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="Run directory [default: runs/experiment-PRESET].",
)
@click.option("--fresh", is_flag=True, help="Start over instead of resuming what OUTPUT already holds.")
@click.option(
    "--seeds",
    type=int,
    default=1,
    show_default=True,
    help="Repeat the whole study with train.seed + 1, + 2, ... into OUTPUT/seeds/ and report merge - anneal "
    "across seeds (mean, s.d.); costs K studies.",
)
@click.option(
    "--print-config", is_flag=True, help="Print the preset's config file (to start your own) and stop."
)
def experiment(
    config: Path | None,
    preset: str | None,
    corpus: str | None,
    output: Path | None,
    fresh: bool,
    print_config: bool,
    seeds: int,
) -> None:
    """Train a small model, fork annealed baselines, merge its snapshots over N, V and weightings, and report.

    With no arguments this is the demo: about 19 minutes on 2 idle CPU cores with native bf16 (27 in fp32).
    Re-running resumes.
    """
    from pmakit.config import load, printable_preset

    data = load(config, preset, default_preset="demo")
    if print_config:
        text = printable_preset(data["preset"]) if config is None else json.dumps(data, indent=2)
        click.echo(text.rstrip("\n"))
        return
    if corpus is not None:
        data.setdefault("train", {})["corpus"] = corpus
    from pmakit.lab.runner import run_experiment
    from pmakit.report import summary_text

    run_dir = output or Path("runs") / f"experiment-{data['preset']}"
    run_experiment(data, run_dir, fresh=fresh, seeds=seeds)
    click.echo(summary_text(run_dir))


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def report(run_dir: Path) -> None:
    """Rebuild RUN_DIR's report (report.md, report.html, plots/) from its results and print the summary."""
    from pmakit.report import summary_text, write_report

    paths = write_report(run_dir)
    click.echo(summary_text(run_dir))
    click.echo(f"wrote {paths.html}")


@cli.command("scaling-fit")
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RESULTS...")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=Path("scaling-fit"),
    show_default=True,
    help="Directory for scaling_fit.json and scaling_fit.png.",
)
@click.option(
    "--holdout",
    type=click.Choice(["largest", "none"]),
    default=None,
    help="Leave the largest model size out of both fits and predict its annealed loss, or fit everything "
    "[default: a study's results file: the study's own; else largest].",
)
@click.option(
    "--bootstrap",
    type=click.IntRange(min=0),
    default=None,
    help="Bootstrap refits (points resampled) for the 95% intervals [default: a study's results file: the "
    "study's own count, so the intervals are its report's; else 400].",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the bootstrap resampling.")
def scaling_fit(
    results: tuple[Path, ...], output: Path, holdout: str | None, bootstrap: int | None, seed: int
) -> None:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta separately to merged and annealed losses.

    RESULTS are CSV or JSONL files with columns params (N), tokens (D), loss (or val_loss) and kind (merge or
    anneal; other rows are skipped), e.g. RUN/results.jsonl of `pmakit experiment --preset scaling` or your own
    runs. Prints the parameters with 95% bootstrap intervals, the held-out size's prediction errors, a backtest
    (each fitted size from the fourth on predicted from the smaller ones) and the law's floor at each size (the
    least error any law of this form can have there: above 1% at the held-out size, no fit can meet 1%).
    """
    from pmakit.report.scaling import fit_files, fit_text

    out = fit_files(list(results), output, holdout=holdout, bootstrap=bootstrap, seed=seed)
    click.echo(fit_text(out.study))
    click.echo(f"wrote {out.json_path}" + (f", {out.plot_path}" if out.plot_path else ""))


@cli.command("sweep-rank")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RUN...")
@click.option(
    "--at",
    callback=_tokens,
    default=None,
    help="Rank at this token count (e.g. 500K): each run's snapshots at or before it [default: the newest count "
    "every run has reached].",
)
@click.option(
    "--last",
    "n",
    type=int,
    default=10,
    show_default=True,
    help="Snapshots in each run's merge (SMA of the last N).",
)
@click.option(
    "--eval",
    "data",
    type=str,
    default=None,
    help="Held-out data, as for `pmakit tune`: 'corpus' (the first run's own held-out split) [default], a token "
    "file or text; every run is scored on the same test batches.",
)
@click.option("--batches", type=int, default=16, show_default=True, help="Held-out test batches.")
@click.option(
    "--bootstrap",
    type=int,
    default=1000,
    show_default=True,
    help="Resamples of the batches for P(best), ranks.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the resampling and file order.")
@click.option(
    "--metric",
    default=None,
    metavar="TASK/METRIC",
    help="Rank by a downstream metric of the first run's held-out tasks through lm-eval (pmakit_next_line/acc), "
    "per test item, instead of the held-out loss.",
)
def sweep_rank(runs: tuple[Path, ...], **options: Any) -> None:
    """Rank the runs of a hyper-parameter sweep early, by merges instead of anneals.

    Each RUN (a `pmakit train` run directory, an experiment, or a directory of snapshots) is merged with the fixed
    recipe (SMA of its last N snapshots at or before --at, N = --last) and scored on the same held-out batches. Prints each
    run's loss, its paired difference to the best, the share of batch resamples in which it is the best and its
    rank's 95% range. docs/sweeps.md says how far an early ranking can be trusted.
    """
    from pmakit.lab.sweep import rank_runs, render_ranking

    click.echo(render_ranking(rank_runs(list(runs), **options)))


@cli.command()
@click.argument(
    "inputs", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RUN_DIR|SNAPSHOT..."
)
@click.option(
    "--last",
    type=click.IntRange(min=3),
    default=None,
    help="Analyse the last N snapshots [default: an experiment's best SMA window at its last fork, else 8].",
)
@click.option(
    "--grid", type=click.IntRange(min=2), default=11, show_default=True, help="Grid points per axis."
)
@click.option(
    "--batches",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Held-out batches per evaluation.",
)
@click.option(
    "--corpus",
    type=str,
    default=None,
    help="Evaluate on this corpus instead of the run's held-out split (a text file when no run config is found).",
)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Output directory.")
def analyze(
    inputs: tuple[Path, ...], last: int | None, grid: int, batches: int, corpus: str | None, output: Path
) -> None:
    """Loss on a 2-D plane through a window's snapshots, and the merge's cross terms (paper E11, E12).

    Writes OUTPUT/plane.json, OUTPUT/plane.png and OUTPUT/summary.txt. Costs grid² + 3k evaluations of
    BATCHES held-out batches for k snapshots.
    """
    from pmakit.lab.plane import analyze as run_analysis

    run_analysis(inputs, output, last=last, grid=grid, batches=batches, corpus=corpus)
    click.echo((output / "summary.txt").read_text().rstrip())
    click.echo(f"wrote {output / 'plane.json'}, {output / 'plane.png'}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path), metavar="RUN")
@click.option(
    "--eval",
    "data",
    type=str,
    default=None,
    help="Held-out data: 'corpus' (the run's own held-out split) [default], a token file (.npy/.bin of token ids; "
    "cut into two contiguous halves) or a text file/directory/glob (tokenized with the snapshot's tokenizer, "
    "divided by file). Selection and test splits are disjoint.",
)
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Directory of the tuned merge."
)
@click.option(
    "--budget-evals",
    type=int,
    default=None,
    help="Trials, each one evaluation on the selection split (the 2 baselines included) [default: 40 without "
    "--budget-seconds]. The test split costs 3 more.",
)
@click.option(
    "--budget-seconds",
    type=float,
    default=None,
    help="Start no new trial after this many seconds (with --budget-evals: whichever comes first).",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the TPE sampler and file order."
)
@click.option(
    "--batches", type=int, default=16, show_default=True, help="Held-out batches per split (selection, test)."
)
@click.option(
    "--max-n", type=int, default=16, show_default=True, help="Largest number of snapshots N searched."
)
@click.option(
    "--eval-cmd",
    type=str,
    default=None,
    help="For a model too big to evaluate in memory: a shell command run on each candidate merge, written to "
    "disk; {model} is its directory, {split} is 'selection' or 'test'; the last number it prints is the loss "
    "(no paired s.e. then).",
)
@click.option(
    "--compile",
    is_flag=True,
    help="Evaluate through torch.compile: ~20 s once, then each batch ~0.8x as long on CPU (pays for long "
    "searches; needs a C++ compiler, else a warning and the eager forward).",
)
@click.option(
    "--learn-steps",
    type=int,
    default=20,
    show_default=True,
    help="After the search (outside its budget): fit the weights over the best window by gradient descent on the "
    "selection split (a learned soup, w = softmax(z)), this many Adam steps of 8 batches; kept only if better on "
    "selection. 0: off. Not with --eval-cmd.",
)
@click.option(
    "--race/--no-race",
    default=True,
    show_default=True,
    help="Stop a trial part way once it is worse than the best so far beyond doubt (paired t over the batches "
    "seen, one-sided p < 0.001, looked at after 1/4, 1/2 and 3/4 of them, from 4 batches on). --no-race: "
    "every trial on every batch.",
)
@click.option(
    "--metric",
    default=None,
    metavar="TASK/METRIC",
    help="Choose by a downstream metric of the run's held-out tasks through lm-eval (pmakit_next_line/acc, "
    "pmakit_bpb/bits_per_byte) instead of the held-out loss: selection items choose, test items report.",
)
@click.option("--force", is_flag=True, help="Replace OUTPUT if it is a merge pmakit wrote.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def tune(run_dir: Path, data: str | None, output: Path, quiet: bool, **options: Any) -> None:
    """Search N, V, window end and weighting (incl. free weights) for RUN's merge on a selection split, confirm
    on a disjoint test split against the newest snapshot and the fixed recipe (SMA, N=10), write the merge.

    Writes OUTPUT (a merged model, loads like any merge) with OUTPUT/tune.json (every trial, both splits).
    """
    from pmakit.lab.tune import TuneConfig, render, tune

    if options["budget_evals"] is None and options["budget_seconds"] is None:
        options["budget_evals"] = 40
    if quiet:
        logging.getLogger("pmakit").setLevel(logging.WARNING)
    record = tune(run_dir, output, data=data, config=TuneConfig(**options))
    click.echo(render(record))


@cli.command("eval")
@click.argument("targets", nargs=-1, required=True, type=LOCATION, metavar="RUN|SNAPSHOT|MODEL_DIR...")
@click.option(
    "--merge",
    "recipes",
    multiple=True,
    metavar="RECIPE",
    help="A merge of each run to evaluate (repeatable): latest, back:K, sma:N, wma:N, ema:ALPHA[:N], "
    "wsm:SHAPE:N (+ :every=V :until=T), or a pmakit tune output [default: latest].",
)
@click.option(
    "--tasks",
    required=True,
    help="Comma-separated lm-eval tasks: pmakit_next_line, pmakit_bpb, pmakit_loss (built from the run's held-out "
    "files), lm-eval's own (data in the local HF cache), or tasks of --include folders.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="The first N items of each task.")
@click.option(
    "--split",
    type=click.Choice(["selection", "test"]),
    default="test",
    show_default=True,
    help="Item split of pmakit's tasks: choose on selection, report on test.",
)
@click.option(
    "--noise",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="Evaluate the K newest raw snapshots of each run: the noise band a merge's gain is read against.",
)
@click.option("--reference", default=None, help="A recipe or target every model is also compared with.")
@click.option(
    "--include", multiple=True, type=click.Path(path_type=Path), help="A folder of lm-eval task YAMLs."
)
@click.option(
    "--corpus-of",
    type=click.Path(path_type=Path),
    default=None,
    help="The run whose held-out files pmakit's tasks are built from [default: the first run among TARGETS].",
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="lm-eval batch size."
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="evals.jsonl to append to and resume from (a folder: FOLDER/evals.jsonl) [default: RUN/evals.jsonl].",
)
def eval_(targets: tuple[Path | str, ...], recipes: tuple[str, ...], tasks: str, **options: Any) -> None:
    """Evaluate runs' merges (in memory), snapshots or model folders on lm-eval tasks: each score with its s.e.
    over items, every model's paired difference to the latest snapshot, and the raw snapshots' noise band."""
    from pmakit.eval.run import command

    command(_local(targets), list(recipes), [t.strip() for t in tasks.split(",") if t.strip()], **options)


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="pmakit")
    finally:
        signal.signal(signal.SIGTERM, _exit_quietly)


if __name__ == "__main__":
    main()
