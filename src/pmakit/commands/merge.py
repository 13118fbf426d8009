"""``pmakit merge`` and ``pmakit inspect``: average snapshots chosen by tokens, or say what a merge would do."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from pmakit.commands import options as opt
from pmakit.errors import PmakitError
from pmakit.layouts import out_formats
from pmakit.layouts.kinds import describe, listing
from pmakit.selection import DEFAULT_WINDOW_RULE
from pmakit.units import format_bytes, format_tokens


def _select(inputs: Sequence[Path | str], **selection: Any) -> list[Any]:
    from pmakit.selection import select_for_merge

    return select_for_merge(inputs, **selection)


@click.command()
@click.argument("inputs", nargs=-1, required=True, type=opt.LOCATION, metavar="RUN_DIR|SNAPSHOT|URL...")
@click.option(
    "-o",
    "--output",
    required=True,
    type=opt.LOCATION,
    help="Output model directory, or an s3:// / gs:// URL (made locally, then uploaded; manifest last).",
)
@opt.method("Weighting over the chosen snapshots, oldest to newest (see README for the exact formulas).")
@opt.alpha(None, "EMA factor for ema / ema-normalized (only those) [default: 0.2].")
@click.option(
    "--weights",
    "custom",
    callback=opt.floats,
    metavar="W1,W2,...",
    help="Custom weights, oldest first, one per chosen snapshot; normalised (with a warning) if their "
    "sum is not 1. Replaces --method.",
)
@opt.selection
@click.option(
    "--recipe",
    default=None,
    metavar="RECIPE",
    help="The snapshots and weights in the grammar pmakit eval, tune and sweep-rank use: latest, back:K, sma:N, "
    "wma:N, ema:ALPHA[:N], wsm:SHAPE:N (+ :every=V :until=T), or a pmakit tune output. Replaces --method, "
    "--alpha, --weights, --last, --every and --until.",
)
@opt.dtype("Output dtype of float tensors (accumulation is always fp32).", show_default=True)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    callback=opt.size,
    help="Largest output shard (bytes, or with KB/MB/GB/KiB/MiB/GiB); a larger tensor gets its own.",
)
@opt.force("Replace OUTPUT if it exists (only once the new merge is complete).")
@click.option("--dry-run", is_flag=True, help="Show what would be merged and stop.")
@opt.quiet()
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
@opt.buffers()
@opt.device()
@opt.doc(
    f"""Average snapshots chosen by tokens into a model directory (HF safetensors layout).

    A RUN_DIR is a folder of snapshot directories (default window: {DEFAULT_WINDOW_RULE}); SNAPSHOTs named one
    by one are all used. Under `torchrun --nproc-per-node K -m pmakit merge ...` the K ranks share the work.
    """
)
def merge(device: str, quiet: bool, **options: Any) -> None:
    from pmakit.world import init_from_env, shutdown

    if options["recipe"] is not None:
        _check_recipe_alone(click.get_current_context())
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
    recipe: str | None,
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
    from pmakit.merge import execute, plan_merge

    chosen, weights, (method, alpha, custom, last, every, until) = _choose(
        inputs, recipe, (method, alpha, custom, last, every, until), tokens_per_step, exclude
    )
    terms, term_weights, window = chosen, weights, None
    extra: dict[str, Any] = {}
    if from_previous is not None:
        terms, term_weights, window, extra["incremental"] = _incremental(
            from_previous, chosen, weights, method, alpha, custom, quiet, buffers
        )
        keep_fp32 = True
    # the shard plan over the world's ranks; an incremental update's terms in the full merge's dtypes
    plan = plan_merge(
        terms,
        term_weights,
        dtype=dtype,
        max_shard_size=max_shard_size,
        ranks=world.size,
        buffers=buffers,
        window=window[0] if window else None,
    )
    if (dry_run and world.rank == 0) or not quiet:
        _print_plan(plan, incremental=window is not None)
    if dry_run:
        return
    extra.update(
        _merge_record(inputs, method, alpha, custom, last, every, until),
        **({"recipe": recipe} if recipe else {}),
    )
    with opt.progress(_rank_input_bytes(plan, world.rank), quiet, "merging") as progress:
        result = execute(
            plan,
            output,
            force=force,
            progress=progress,
            manifest_extra=extra,
            resume=resume,
            out_format=None if out_format == "native" else out_format,
            keep_fp32=keep_fp32,
            world=world,
            window=window,
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


Choice = tuple[str, float, "list[float] | None", "int | None", "int | None", "int | None"]
"""What --method, --alpha, --weights, --last, --every and --until say."""


def _choose(
    inputs: Sequence[Path | str],
    recipe: str | None,
    options: tuple[str, float | None, list[float] | None, int | None, int | None, int | None],
    tokens_per_step: int | None,
    exclude: Sequence[Path],
) -> tuple[list[Any], list[float], Choice]:
    """The snapshots, their weights and the options they stand for: the recipe's, or the options'."""
    from pmakit.weights import get_weights, uses_alpha

    if recipe is not None:
        return _from_recipe(recipe, inputs, tokens_per_step, exclude)
    method, alpha, custom, last, every, until = options
    if alpha is not None and (custom is not None or not uses_alpha(method)):
        raise PmakitError(
            f"--alpha is the EMA factor: it does nothing with --{'weights' if custom else 'method ' + method}"
        )
    a = 0.2 if alpha is None else alpha
    chosen = _select(
        inputs, last=last, every=every, until=until, tokens_per_step=tokens_per_step, exclude=exclude
    )
    weights = get_weights("custom" if custom is not None else method, len(chosen), alpha=a, custom=custom)
    return chosen, weights, (method, a, custom, last, every, until)


RECIPE_REPLACES = ("method", "alpha", "custom", "last", "every", "until")


def _check_recipe_alone(ctx: click.Context) -> None:
    """--recipe says the window and the weights: an option that says them too is one error, not a silent pick."""
    from click.core import ParameterSource

    given = [p for p in RECIPE_REPLACES if ctx.get_parameter_source(p) not in (None, ParameterSource.DEFAULT)]
    if given:
        flag = {"custom": "weights"}.get(given[0], given[0])
        raise PmakitError(f"--recipe says the snapshots and weights: it does not take --{flag} too")


def _from_recipe(
    text: str, inputs: Sequence[Path | str], tokens_per_step: int | None, exclude: Sequence[Path]
) -> tuple[list[Any], list[float], Choice]:
    """A recipe's snapshots and weights among the inputs' (``pmakit.merge.recipe``, as pmakit eval resolves it),
    and the --method/--alpha/--weights/--last/--every/--until it stands for (the manifest's record, and what
    --from-previous updates: a sma/ema recipe is the same merge as those options)."""
    from pmakit.merge.recipe import parse_recipe, resolve
    from pmakit.snapshot import gather
    from pmakit.weights import uses_alpha

    recipe = parse_recipe(text)
    snapshots, _ = gather(inputs, tokens_per_step, exclude)
    resolved = resolve(recipe, snapshots)
    chosen, weights = list(resolved.snapshots), list(resolved.weights)
    if recipe.raw or recipe.method == "tune":  # one raw snapshot, or a tuned set: its weights as they are
        return chosen, weights, ("custom", 0.2, weights, None, None, recipe.until)
    alpha = recipe.alpha if uses_alpha(recipe.method) else 0.2
    return chosen, weights, (recipe.method, alpha, None, recipe.n, recipe.every, recipe.until)


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
    from pmakit.storage.mirror import origin

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


@click.command()
@click.argument("inputs", nargs=-1, type=opt.LOCATION, metavar="RUN_DIR|SNAPSHOT|URL...")
@opt.selection
@opt.dtype("Output dtype assumed for the merge estimate.")
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
    callback=opt.size,
    default=None,
    metavar="BYTES",
    help="With --plan: a node's disk read/write bytes per second (e.g. 2GB) [default: measured here].",
)
@click.option(
    "--accumulate-bandwidth",
    callback=opt.size,
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
            _select(
                inputs, last=last, every=every, until=until, tokens_per_step=tokens_per_step, exclude=exclude
            )
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
        inputs,
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


def register(group: click.Group) -> None:
    group.add_command(merge)
    group.add_command(inspect)
