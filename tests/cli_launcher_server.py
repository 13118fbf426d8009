"""The launcher process of tests/cli_launcher.py: loads the `pmakit` command once, then forks a child per request.
With the argument ``pinned``, it first sets what ``pmakit._env.portable_math`` sets for the commands that train.

Requests are JSON lines on stdin ({args, cwd, env, out, err}); for each, the launcher writes the child's pid, then
its exit status (negative: the signal that ended it, as ``subprocess`` reports it), a line each. A child leaves the
loop and runs the rest of this file: ``python -m pmakit``'s own module, to a normal interpreter exit.
"""

import os
import sys
from typing import Any

import pmakit  # (first, as `python -m pmakit` imports it: its _env before torch)
from pmakit._env import PINNED_COMMANDS, portable_math, start_quickly

# The launcher of the commands that train: their kernels pinned before torch loads
if sys.argv[1:] == ["pinned"]:
    portable_math(PINNED_COMMANDS[0])
start_quickly("pmakit.cli")

import runpy  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402


def serve() -> dict[str, Any]:
    """Answer requests until stdin closes (then exit); return a request in the child forked for it."""
    import json

    if threading.active_count() != 1:  # (numpy's OpenBLAS pool is a native thread: it stops itself at a fork)
        sys.stdout.write(f"the launcher runs {threading.active_count()} Python threads: it cannot fork\n")
        sys.stdout.flush()
        sys.exit(1)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.write(f"{code}\n")
        sys.stdout.flush()
    sys.exit(0)


request = serve()
# The child: the command's own directory, environment, streams and arguments, then `python -m pmakit`.
os.chdir(request["cwd"])
sys.path[0] = os.getcwd()  # as `python -m` sets it
os.environ.clear()
os.environ.update(request["env"])
# The launcher's tempdir was cached ('/tmp'): the command's TMPDIR, read as a new interpreter reads it.
tempfile.tempdir = None
for fd, path, flags in (
    (0, os.devnull, os.O_RDONLY),
    (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
):
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)
sys.stdin = open(0, closefd=False)  # noqa: SIM115  (a fresh reader: the launcher's may hold read-ahead)
sys.argv = [os.path.join(os.path.dirname(pmakit.__file__), "__main__.py"), *request["args"]]
del request
runpy.run_module("pmakit", run_name="__main__", alter_sys=True)
