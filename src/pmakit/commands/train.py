"""Commands that train and study: train a model, run a study, rebuild its report, fit a scaling law."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from pmakit.commands import options as opt
from pmakit.config import preset_names


@click.command()
@click.argument("config", required=False, type=click.Path(path_type=Path))
@click.option(
    "--preset",
    type=str,
    default=None,
    help=f"A shipped config: {', '.join(preset_names())} [default: demo].",
)
@opt.corpus("Text file, directory, glob or .npy/.bin of token ids.")
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


@click.command()
@click.argument("config", required=False, type=click.Path(path_type=Path))
@click.option(
    "--preset",
    type=str,
    default=None,
    help="A shipped study: demo (default), smoke (about a minute), spike (loss-spike recovery, paper E10), "
    "init (continued training from a merge, E9), scaling (scaling laws from merges; scaling-smoke: toy sizes), "
    "sweep (a hyper-parameter sweep ranked early by merges; sweep-smoke: toy size), replicas.",
)
@opt.corpus(
    "Text file, directory, glob or .npy/.bin of token ids [default: the pinned torch package's .py sources; 'stdlib': this Python's standard library]."
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

    With no arguments this is the demo: about 10 minutes on 2 idle CPU cores (fp32, the kernels pinned).
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


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def report(run_dir: Path) -> None:
    """Rebuild RUN_DIR's report (report.md, report.html, plots/) from its results and print the summary."""
    from pmakit.report import summary_text, write_report

    paths = write_report(run_dir)
    click.echo(summary_text(run_dir))
    click.echo(f"wrote {paths.html}")


@click.command("scaling-fit")
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
@opt.seed("Seed of the bootstrap resampling.")
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


def register(group: click.Group) -> None:
    for command in (train, experiment, report, scaling_fit):
        group.add_command(command)
