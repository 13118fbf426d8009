"""The process set-up a library user gets without knowing of it: the OpenMP wait policy, progress from Python."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import SRC
from pmakit.train import loop


def _python(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -c code`` as a user runs it: no OMP_WAIT_POLICY, this checkout's pmakit."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**base, "PYTHONPATH": str(SRC), "PMAKIT_CACHE": str(tmp_path / "cache"), **env},
        cwd=tmp_path,
        timeout=1800,  # a hang guard only
    )


def test_importing_pmakit_first_makes_torchs_threads_wait_passively(tmp_path: Path) -> None:
    code = """
        import os
        from pmakit.train.loop import TrainConfig  # any pmakit module: the package sets up first
        import torch
        from pmakit._env import spinning
        print(os.environ["OMP_WAIT_POLICY"], spinning())
    """
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PASSIVE", "False"]
    assert "OMP_WAIT_POLICY" not in proc.stderr
    # the user's own choice stands
    proc = _python(code, tmp_path, OMP_WAIT_POLICY="ACTIVE")
    assert proc.stdout.split() == ["ACTIVE", "False"], proc.stderr


def test_torch_imported_first_gets_one_warning_naming_the_variable(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(3000)))
    proc = _python(
        f"""
        import torch
        from pmakit.train.loop import TrainConfig, Trainer
        from pmakit.train.model import ModelConfig
        cfg = TrainConfig(corpus={str(corpus)!r}, vocab_size=300, val_fraction=0.25, max_corpus_bytes=None,
                          model=ModelConfig(layers=1, hidden=32, heads=2, seq_len=32), batch_size=4,
                          total_tokens=256, warmup_tokens=128, every_tokens=128, eval_batches=1, threads=1)
        for name in ("a", "b"):
            Trainer(cfg, name).close()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("OMP_WAIT_POLICY=PASSIVE") == 1, proc.stderr
    assert "torch was imported before pmakit" in proc.stderr


OWN_LOOP = """
    import {first}
    import {second}
    from pmakit.online import OnlineAverager
    from pmakit.saver import SnapshotSaver
    print("calling", flush=True)
    averager = OnlineAverager(n=2)
    for name in ("a", "b"):
        SnapshotSaver(name, every_tokens=10).close()
"""


@pytest.mark.parametrize("first", ["averager", "saver"])
def test_a_users_own_loop_is_warned_at_its_first_call_when_torch_came_first(
    tmp_path: Path, first: str
) -> None:
    """Torch imported before pmakit with no OMP_WAIT_POLICY: libgomp started with threads that spin. The first
    pmakit object of the user's own loop (no pmakit.train) says so, once, with the fix."""
    code = OWN_LOOP.format(first="torch", second="pmakit")
    if first == "saver":  # the saver alone, first
        code = code.replace("    averager = OnlineAverager(n=2)\n", "").replace(
            '"b"):\n', '"b"):\n        OnlineAverager(n=2)\n'
        )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("torch was imported before pmakit") == 1, proc.stderr
    assert "Put `import pmakit` before `import torch`" in proc.stderr
    assert "OMP_WAIT_POLICY=PASSIVE" in proc.stderr
    # no warning: pmakit first, or the variable set before Python started
    for env, order in (({}, ("pmakit", "torch")), ({"OMP_WAIT_POLICY": "PASSIVE"}, ("torch", "pmakit"))):
        (where := tmp_path / "-".join(order)).mkdir()
        proc = _python(OWN_LOOP.format(first=order[0], second=order[1]), where, **env)
        assert proc.returncode == 0 and "calling" in proc.stdout, proc.stderr
        assert "imported before pmakit" not in proc.stderr, (env, order)


def test_progress_off_a_terminal_is_a_line_per_interval(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(loop._Progress, "every_s", 0.0)
    bar = loop._Progress(0, 1000, enabled=True, label="run")
    bar.update(250, 5.5)
    bar.close()
    err = capsys.readouterr().err
    assert err.startswith("run: 250/1,000 tokens (25%), loss 5.500, ") and "s left" in err
    quiet = loop._Progress(0, 1000, enabled=False, label="run")
    quiet.update(250, 5.5)
    assert capsys.readouterr().err == ""
    # the default interval: a run shorter than it prints nothing
    monkeypatch.undo()
    loop._Progress(0, 1000, enabled=True, label="run").update(250, 5.5)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("argv", "pinned"),
    [(["pmakit", "experiment"], True), (["pmakit", "train", "-o", "x"], True), (["pmakit", "merge"], False)],
)
def test_training_commands_pin_the_cpu_kernels_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], pinned: bool
) -> None:
    from pmakit import _env

    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    for name in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    _env.portable_math()
    assert (os.environ.get("ATEN_CPU_CAPABILITY"), os.environ.get("MKL_CBWR")) == (
        ("avx2", "AVX2") if pinned else (None, None)
    )
    # inductor's kernel cache is not keyed by the capability: the pinned processes get a folder of their own
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if pinned:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        assert cache == os.path.join(default_cache_dir(), "pmakit-aten-avx2")
    else:
        assert cache is None
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/kernels")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    _env.portable_math()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == (
        "/srv/kernels/pmakit-aten-avx2" if pinned else "/srv/kernels"
    )
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")  # the user's choice stands, and so does their cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/kernels")
    _env.portable_math()
    assert (
        os.environ["ATEN_CPU_CAPABILITY"] == "avx512"
        and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/kernels"
    )


def test_the_default_threads_follow_omp_num_threads_else_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun sets OMP_NUM_THREADS=1 for each of several processes on a node: a training or evaluation left at its
    default follows it rather than start a thread per core in every process; an explicit count wins over both."""
    import torch

    from pmakit.evaluate import cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        cpu_threads(None)
        assert torch.get_num_threads() == 1
        cpu_threads(2)
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        cpu_threads(None)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("exempt", ["", "profiler", "cuda"])
def test_a_command_ends_as_the_interpreter_would_less_the_teardown(tmp_path: Path, exempt: str) -> None:
    # pmakit._env.leave, how every `pmakit` command ends: the threads joined (an executor's queued work done), the
    # atexit handlers run, the streams and a file left open flushed, the code carried (a string: printed, then 1),
    # as Python's own exit does; then no teardown of the modules (an object's __del__ never runs). With a profiler
    # set (cProfile reports after the module returns) or CUDA started (its C exit handlers, which os._exit skips,
    # write a native profiler's trace): Python's own exit, teardown included.
    code = f"""
        import atexit, os, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from pmakit._env import leave

        class Loud:
            def __init__(self):
                self.write = os.write  # (print may be gone while the modules are torn down)
            def __del__(self):
                self.write(1, b"torn down\\n")

        kept = Loud()
        left_open = open("written.txt", "w")
        left_open.write("kept")  # in its buffer, never closed
        sys.stdout.write("buffered\\n")
        threading.Thread(target=lambda: (time.sleep(0.3), sys.stdout.write("thread joined\\n"))).start()
        ThreadPoolExecutor(1).submit(lambda: (time.sleep(0.3), sys.stdout.write("queued work done\\n")))
        atexit.register(lambda: print("atexit ran"))
        if {exempt == "cuda"}:
            import torch
            torch.cuda.is_initialized = lambda: True  # (no GPU here: as a process that started CUDA sees it)
        if {exempt == "profiler"}:
            sys.setprofile(lambda *a: None)
        leave("one line")
    """
    proc = _python(code, tmp_path)
    assert proc.returncode == 1 and proc.stderr == "one line\n", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "buffered" and sorted(lines[1:3]) == ["queued work done", "thread joined"]
    assert lines[3:] == ["atexit ran"] + (["torn down"] if exempt else [])
    assert (tmp_path / "written.txt").read_text() == "kept"
