"""The suite's launcher of `pmakit` commands: a process per command, without paying torch's import each time.

Most of the suite's `pmakit` processes are short (a mistake that must be one Error line, a merge of a few KB), and
each spent ~1.2 s of CPU loading torch and the CLI before doing it: with hundreds of them, minutes of the suite. The
launcher is a process that loads them once, as `python -m pmakit` would (``pmakit`` first, then
``pmakit._env.start_quickly("pmakit.cli")``), then forks a child for each command: the child takes the command's
working directory, environment, arguments and stdin/stdout/stderr, and runs ``python -m pmakit`` 's own code
(``runpy.run_module("pmakit")``) to its exit, as a fresh interpreter would: its exit status, stderr (an uncaught
traceback included) and atexit handlers are its own. The launcher runs no torch operation before it forks (no
thread pool to lose in the child: it checks that it runs one Python thread; numpy's OpenBLAS pool, a native
thread, shuts itself down at a fork and starts again in the child).

The commands that train (experiment, train) pin the CPU's kernels before torch loads (``pmakit._env.portable_math``):
they are forked from a second launcher that set the same variables before it loaded torch. Not for a command whose
environment differs from the launcher's in what is read at import time (the OpenMP, MKL, ATen, CUDA, torch and Python
variables): ``conftest.run_cli`` starts a fresh interpreter for those, and for any test that asks for one
(``fresh=True``). A launcher runs one command at a time: a test that races two commands, or kills one at a moment
counted from its start, starts them with ``subprocess`` as before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pmakit._env import PINNED_COMMANDS

# Variables a process reads while it starts or imports torch: a command whose environment differs from the
# launcher's in one of them gets a fresh interpreter.
IMPORT_TIME = (
    "OMP_",
    "KMP_",
    "MKL",
    "ATEN_",
    "TORCH",
    "PYTORCH",
    "CUDA",
    "NVIDIA",
    "PYTHON",
    "LD_",
    "GOMP",
    "PMAKIT_TESTS_",
)

_SERVER = Path(__file__).resolve().parent / "cli_launcher_server.py"


class Launcher:
    """One launcher process (started on first use, one per pytest process and kind) and the environment it was
    started with; ``pinned``: the launcher of the commands that train."""

    def __init__(self, env: dict[str, str], *, pinned: bool = False) -> None:
        self.env = dict(env)
        self.pinned = pinned
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def takes(self, args: list[str], env: dict[str, str]) -> bool:
        """Whether this command can be forked from this launcher (see the module's text)."""
        if (bool(args) and args[0] in PINNED_COMMANDS) != self.pinned:
            return False
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return not any(k.startswith(IMPORT_TIME) for k in changed)

    def _server(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, str(_SERVER), *(["pinned"] if self.pinned else [])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.env,
            )
            ready = self._proc.stdout.readline()  # type: ignore[union-attr]
            if ready.strip() != b"ready":
                raise RuntimeError(f"the pmakit launcher did not start: {ready!r}")
        return self._proc

    def run(
        self, args: list[str], *, cwd: Path | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Run one command to its end, as ``subprocess.run(..., capture_output=True, text=True)`` would."""
        with self._lock, tempfile.TemporaryDirectory(prefix="pmakit-cli-") as scratch:
            out, err = Path(scratch) / "out", Path(scratch) / "err"
            server = self._server()
            request = {
                "args": args,
                "cwd": str(cwd or os.getcwd()),
                "env": env,
                "out": str(out),
                "err": str(err),
            }
            server.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
            server.stdin.flush()  # type: ignore[union-attr]
            pid = int(self._answer(server))
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                status = int(self._answer(server))
            finally:
                timer.cancel()
            command = [sys.executable, "-m", "pmakit", *args]
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            if killed.is_set():
                raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
            return subprocess.CompletedProcess(command, status, stdout, stderr)

    @staticmethod
    def _answer(server: subprocess.Popen[bytes]) -> bytes:
        line = server.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the pmakit launcher ended (exit status {server.wait()})")
        return line

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            self._proc.wait(timeout=60)
