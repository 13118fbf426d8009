"""Options and argument types that several subcommands take, each declared once, and the helpers they share."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from pmakit.errors import PmakitError
from pmakit.layouts.kinds import BUFFER_RULES, DEFAULT_BUFFERS
from pmakit.selection import DEFAULT_WINDOW_RULE
from pmakit.units import parse_size, parse_tokens
from pmakit.weights import WEIGHTINGS

DTYPES = ["same", "bf16", "fp16", "fp32"]
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


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


class _Location(click.ParamType):
    """A local path, or an ``s3://`` / ``gs://`` URL kept as it is (``click.Path`` would fold its ``//``)."""

    name = "path"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        from pmakit.storage.registry import is_remote

        return value if is_remote(str(value)) else Path(value)


LOCATION = _Location()


def _convert(fn: Callable[[str], int], value: str) -> int:
    try:
        return fn(value)
    except PmakitError as e:
        raise click.BadParameter(str(e)) from None


def tokens(_: click.Context, __: click.Parameter, value: str | None) -> int | None:
    """Callback: a token count such as 500M, 4B, 1.5T."""
    return None if value is None else _convert(parse_tokens, value)


def size(_: click.Context, __: click.Parameter, value: str | None) -> int | None:
    """Callback: a byte count such as 5GB or 512MiB."""
    return None if value is None else _convert(parse_size, value)


def floats(_: click.Context, __: click.Parameter, value: str | None) -> list[float] | None:
    """Callback: comma-separated numbers."""
    if value is None:
        return None
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


def stack(*options: Decorator) -> Decorator:
    """Several options as one decorator, in the order given (as they appear in ``--help``)."""

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def doc(text: str) -> Decorator:
    """A command's help built from constants (click reads the docstring)."""

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.__doc__ = text
        return fn

    return apply


def quiet(help: str = "No progress bar and no summary.") -> Decorator:
    return click.option("--quiet", "-q", is_flag=True, help=help)


def force(help: str = "Replace OUTPUT if it exists.") -> Decorator:
    return click.option("--force", is_flag=True, help=help)


def dtype(help: str, show_default: bool = False) -> Decorator:
    return click.option(
        "--dtype", type=click.Choice(DTYPES), default="same", show_default=show_default, help=help
    )


def method(help: str) -> Decorator:
    return click.option("--method", type=METHODS, default="sma", show_default=True, help=help)


def alpha(default: float | None, help: str) -> Decorator:
    return click.option("--alpha", type=float, default=default, show_default=default is not None, help=help)


def seed(help: str) -> Decorator:
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def corpus(help: str) -> Decorator:
    return click.option("--corpus", type=str, default=None, help=help)


def held_out(help: str) -> Decorator:
    return click.option("--eval", "data", type=str, default=None, help=help)


def metric(help: str) -> Decorator:
    return click.option("--metric", default=None, metavar="TASK/METRIC", help=help)


def tokens_per_step() -> Decorator:
    return click.option(
        "--tokens-per-step",
        type=click.IntRange(min=1),
        default=None,
        help="Tokens per step, for snapshots without token metadata (HF checkpoint-N, step-N dirs, "
        "Lightning .ckpt files).",
    )


def buffers() -> Decorator:
    return click.option(
        "--buffers",
        type=click.Choice(list(BUFFER_RULES)),
        default=DEFAULT_BUFFERS,
        show_default=True,
        help="MoE routers' load-balancing biases (expert_bias, score_bias, e_score_correction_bias): averaged "
        "like the weights, or the newest snapshot's; written in fp32 either way. Counters (tokens per expert) "
        "are always the newest's. See docs/moe.md.",
    )


def device() -> Decorator:
    return click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default="cpu",
        show_default=True,
        help="Where to accumulate; under torchrun, cuda uses NCCL and cpu uses gloo.",
    )


def selection(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--last/--every/--until/--tokens-per-step/--exclude, shared by merge and inspect."""
    return stack(
        click.option(
            "--last",
            type=int,
            default=None,
            help=f"How many snapshots N to merge [default from a run directory: {DEFAULT_WINDOW_RULE}; every "
            "snapshot named one by one].",
        ),
        click.option(
            "--every",
            callback=tokens,
            metavar="TOKENS",
            help="Spacing V between chosen snapshots, going back from the window's end (500M, 4B, 1.5T).",
        ),
        click.option(
            "--until",
            callback=tokens,
            metavar="TOKENS",
            help="The window ends at the newest snapshot with tokens <= TOKENS [default: the newest].",
        ),
        tokens_per_step(),
        click.option(
            "--exclude",
            multiple=True,
            type=click.Path(path_type=Path),
            help="Leave this snapshot out (repeatable).",
        ),
    )(fn)


def local(locations: Sequence[Path | str]) -> list[Path]:
    """Command-line locations as local paths: object storage URLs as local mirrors (``pmakit.storage``)."""
    if not any(isinstance(x, str) for x in locations):
        return [Path(x) for x in locations]
    from pmakit.storage import local_all

    return local_all(locations)


@contextmanager
def progress(total: int, quiet: bool, label: str) -> Iterator[Callable[[int], None] | None]:
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
