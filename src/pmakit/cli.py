"""The ``pmakit`` command: the group, its error handling, and the rooms' subcommands (``pmakit.commands``)
registered on it. Each subcommand parses options and calls the library; errors are one line."""

from __future__ import annotations

import pmakit._env  # noqa: F401  (before torch)

# isort: split

import errno
import logging
import os
import signal
import sys
from contextlib import suppress
from typing import Any

import click

from pmakit.commands import merge as merge_commands
from pmakit.commands import runs as run_commands
from pmakit.commands import train as train_commands
from pmakit.errors import PmakitError, redact


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


for _room in (merge_commands, run_commands, train_commands):
    _room.register(cli)


def main() -> None:
    """Console-script entry point."""
    try:
        cli(prog_name="pmakit")
    finally:
        signal.signal(signal.SIGTERM, _exit_quietly)


if __name__ == "__main__":
    main()
