"""Commands over runs: roll back a spike (recover), tune a merge, analyse the loss plane, rank a sweep, evaluate."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click

from pmakit.commands import options as opt
from pmakit.runs import checkpoint_dir
from pmakit.units import format_tokens


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Output snapshot directory."
)
@click.option(
    "--before",
    callback=opt.tokens,
    metavar="TOKENS",
    help="Merge only snapshots with tokens strictly below TOKENS (where the spike began) "
    "[default: find the spike in RUN_DIR/metrics.jsonl].",
)
@click.option("--last", type=int, default=3, show_default=True, help="How many snapshots K to merge.")
@opt.method("Weighting of the K.")
@opt.alpha(0.2, "EMA factor for ema / ema-normalized.")
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
@opt.force()
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


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path), metavar="RUN")
@opt.held_out(
    "Held-out data: 'corpus' (the run's own held-out split) [default], a token file (.npy/.bin of token ids; "
    "cut into two contiguous halves) or a text file/directory/glob (tokenized with the snapshot's tokenizer, "
    "divided by file). Selection and test splits are disjoint."
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
@opt.seed("Seed of the TPE sampler and file order.")
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
@opt.metric(
    "Choose by a downstream metric of the run's held-out tasks through lm-eval (pmakit_next_line/acc, "
    "pmakit_bpb/bits_per_byte) instead of the held-out loss: selection items choose, test items report."
)
@opt.force("Replace OUTPUT if it is a merge pmakit wrote.")
@opt.quiet("No progress bar.")
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


@click.command()
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
@opt.corpus(
    "Evaluate on this corpus instead of the run's held-out split (a text file when no run config is found)."
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


@click.command("sweep-rank")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="RUN...")
@click.option(
    "--at",
    callback=opt.tokens,
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
@opt.held_out(
    "Held-out data, as for `pmakit tune`: 'corpus' (the first run's own held-out split) [default], a token "
    "file or text; every run is scored on the same test batches."
)
@click.option("--batches", type=int, default=16, show_default=True, help="Held-out test batches.")
@click.option(
    "--bootstrap",
    type=int,
    default=1000,
    show_default=True,
    help="Resamples of the batches for P(best), ranks.",
)
@opt.seed("Seed of the resampling and file order.")
@opt.metric(
    "Rank by a downstream metric of the first run's held-out tasks through lm-eval (pmakit_next_line/acc), "
    "per test item, instead of the held-out loss."
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


@click.command("eval")
@click.argument("targets", nargs=-1, required=True, type=opt.LOCATION, metavar="RUN|SNAPSHOT|MODEL_DIR...")
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

    command(opt.local(targets), list(recipes), [t.strip() for t in tasks.split(",") if t.strip()], **options)


def register(group: click.Group) -> None:
    for command in (recover, tune, analyze, sweep_rank, eval_):
        group.add_command(command)
