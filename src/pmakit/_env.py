"""Process set-up for entry points; import before torch."""

import os
from types import ModuleType

# On a shared 2-core machine, OpenMP threads that spin while waiting made a 0.14 s training step take 2.2 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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


def run_cli() -> None:
    """The ``pmakit`` command (console script and ``python -m pmakit``)."""
    start_quickly("pmakit.cli").main()
