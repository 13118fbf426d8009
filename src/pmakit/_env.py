"""Process set-up, done when ``pmakit`` is imported: before torch wherever the user imports pmakit first."""

import logging
import os
import platform
import sys
from types import ModuleType
from typing import NoReturn

log = logging.getLogger(__name__)

# On a shared 2-core machine, OpenMP threads that spin while waiting made a 0.14 s training step take 2.2 s (a
# 160K-token run from Python: 251 s, 13.8 s passive). libgomp reads the variable once, when torch loads it: set
# here it only counts when pmakit is imported before torch; otherwise ``warn_if_spinning`` says so, once.
_USER_POLICY = os.environ.get("OMP_WAIT_POLICY")
TORCH_FIRST = "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_warned = False


def spinning() -> bool:
    """Whether torch's OpenMP threads may spin while they wait: torch was loaded before pmakit set the policy,
    and the user set none."""
    return TORCH_FIRST and _USER_POLICY is None


def warn_if_spinning() -> bool:
    """Log one warning per process when torch's threads may spin (see ``spinning``); True if it warned now."""
    global _warned
    if _warned or not spinning():
        return False
    _warned = True
    log.warning(
        "torch was imported before pmakit, so its OpenMP threads spin while they wait: on a busy machine "
        "training runs up to 20x slower. Put `import pmakit` "
        "before `import torch` (the first import of your script), or set OMP_WAIT_POLICY=PASSIVE in the "
        "environment."
    )
    return True


def start_quickly(module: str) -> ModuleType:
    """Import ``module`` (and torch with it) for a process that runs one command and ends.

    With torch imported the interpreter holds ~10^6 objects: the cyclic garbage collector runs over them while
    torch imports (~0.15 s here) and again at exit (~0.5 s of a 3 s merge). They are never garbage: the collector
    is off while the modules import, and they are frozen after it (``gc.freeze``: left out of every later
    collection, the interpreter's last one included). What the command itself makes is collected as usual (frozen
    too, triton's nanobind objects are reported as leaked at exit).
    """
    import gc
    import importlib

    gc.disable()
    try:
        loaded = importlib.import_module(module)
    finally:
        gc.enable()
    gc.freeze()
    return loaded


PINNED_COMMANDS = ("experiment", "train")
"""The commands whose float results ``portable_math`` pins: the ones that train."""


def portable_math(command: str | None = None) -> None:
    """Make the command's float results the same on every x86-64 CPU: set before torch loads, unless the user did.
    ``command``: the pmakit command about to run (default: this process's, ``sys.argv[1]``).

    ATen's kernels and MKL's GEMM pick their vector code by CPU (AVX2, AVX-512, AMX), and each width sums in another
    order: 30 fp32 steps of the demo's model end with other weights under AVX-512 kernels than under AVX2 ones, so
    two machines drift apart. Pinned to AVX2 (every x86-64 CPU of the last decade has it), the same run gives the
    same bits (measured: identical weights at 1, 2 and 8 threads).
    Only the commands that train (``PINNED_COMMANDS``): their numbers are the ones a README or a paper
    quotes; the others keep the fastest kernels (``tune --compile``'s choices match its eager run's with them).

    Inductor's compiled-kernel cache is not keyed by ``ATEN_CPU_CAPABILITY``: a kernel built under AVX-512 and loaded
    under the AVX2 pin (or the reverse) gives wrong numbers without an error (measured with torch 2.13: -inf where
    -17.91 was right, NaN losses in a compiled training step). So where pmakit sets the pin it also gives the pinned
    processes a cache folder of their own, beside the user's (``TORCHINDUCTOR_CACHE_DIR`` or torch's default).
    """
    if command is None:
        command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command not in PINNED_COMMANDS:
        return
    if platform.machine().lower() in ("x86_64", "amd64") and "ATEN_CPU_CAPABILITY" not in os.environ:
        os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
        os.environ.setdefault("MKL_CBWR", "AVX2")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_inductor_cache_dir(), "pmakit-aten-avx2")


def _inductor_cache_dir() -> str:
    """The folder torch's inductor caches compiled kernels in: ``TORCHINDUCTOR_CACHE_DIR``, else torch's default
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, repeated here: torch is not loaded yet)."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen:
        return os.path.abspath(chosen)
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def prefetch_inputs(argv: list[str]) -> None:
    """Begin mirroring the object-storage inputs of a command that reads them (``merge``, ``inspect``, ``eval``)
    while torch imports (``pmakit.storage.mirror.prefetch``): the URLs among its arguments, except an output's
    (``-o``/``--output``). The command's own parsing decides what each argument is; a URL it does not take as an
    input is never used."""
    if argv[:1] not in (["merge"], ["inspect"], ["eval"]):
        return
    urls, after_output = [], False
    for token in argv[1:]:
        if not after_output and token.startswith(("s3://", "gs://")):
            urls.append(token)
        after_output = token in ("-o", "--output")
    if urls:
        from pmakit.storage.mirror import prefetch  # the standard library (and the store's client): not torch

        prefetch(urls)


def run_cli() -> None:
    """The ``pmakit`` command (console script and ``python -m pmakit``)."""
    portable_math()
    prefetch_inputs(sys.argv[1:])
    cli = start_quickly("pmakit.cli")
    try:
        cli.main()
    except SystemExit as e:
        leave(e.code)
    leave(0)


def leave(code: object) -> NoReturn:
    """End a command's process as the interpreter would, less the teardown of its modules.

    The interpreter's exit does, in order: wait for the threads (``threading._shutdown``: executors' workers told
    to stop, every non-daemon thread joined), run the ``atexit`` handlers (the mirrors' folders removed, logging
    flushed, ``weakref.finalize`` callbacks such as temporary folders'), flush the standard streams, and then free
    every object of every module, one by one: with torch loaded ~10^6 objects, 0.05-0.3 s (0.6 s with transformers'
    Llama loaded too), and in a process forked from one that had loaded torch (the suite's launchers) each page of
    that heap is copied as its counts change (a short command through a launcher: 196 ms, 52 ms without the
    teardown). What the teardown gives a command is the closing of the file objects still open: their buffers are
    flushed here (the buffered files ``open`` makes, found by the collector among the objects made since the
    imports). The rest is done as the interpreter does it, and the process ends (``os._exit``) with the code
    ``SystemExit`` carried (a string printed to stderr, then 1, as Python does). Not with a profiler or a tracer
    set (``python -m cProfile -m pmakit`` reports after the module returns), nor in a process that started CUDA
    (``os._exit`` skips the C exit handlers too: CUDA's own, which a native profiler such as Nsight Systems relies on
    to write its trace; the teardown is a small part of a GPU command), nor where ``threading._shutdown`` is
    missing: then the usual exit."""
    import atexit
    import gc
    import io
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    torch = sys.modules.get("torch")
    cuda = torch is not None and torch.cuda.is_initialized()
    if shutdown is None or cuda or sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)  # type: ignore[arg-type]
    shutdown()
    atexit._run_exitfuncs()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    buffered = frozenset((io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair))
    files = [obj for obj in gc.get_objects() if type(obj) in buffered]  # 0.05 s for 3x10^5 objects
    for obj in [*files, sys.stdout, sys.stderr]:
        try:
            obj.flush()
        except Exception:  # closed, read-only, or a pipe its reader closed (`pmakit ... | head`)
            if obj in (sys.stdout, sys.stderr) and not obj.closed:
                code = code or 120  # as Python says a failed flush of its streams at exit
    os._exit(code)
