"""Faults: kill -9 of `pmakit merge` and of `pmakit train` at many moments, concurrent `--force` merges into one
output, and a disk that fills up (a real tmpfs when this process may mount one).

A merge killed at any moment and run again with the very same command ends with the uninterrupted merge's bytes;
a training run killed at any moment and resumed has one record per step in its metrics, a clock that only moves
forward, and the uninterrupted run's weights.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from conftest import cli_env, run_cli, state, write_snapshot
from pmakit.cli import cli
from pmakit.metrics import read_metrics

STEPS = (100, 200, 300, 400)
SHAPES = {f"layers.{i}.weight": (256, 256) for i in range(8)}
ENV = cli_env()


def build_run(root: Path) -> Path:
    run = root / "run"
    for i, step in enumerate(STEPS, 1):
        write_snapshot(run / f"step-{step:06d}", state(i, torch.float32, SHAPES), step=step, tokens=step * 10)
    return run


def pmakit(*args: Any) -> list[str]:
    return [sys.executable, "-m", "pmakit", *map(str, args)]


def weights_of(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out.glob("*.safetensors"))}


def manifest_matches_bytes(out: Path) -> dict[str, Any]:
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    for f in manifest["output"]["files"]:
        data = (out / f["name"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"], f["name"]
    return dict(manifest)


def test_merge_killed_at_random_moments_then_run_again(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    cmd = ["merge", run, "--last", "3", "--max-shard-size", "300KB", "--dtype", "bf16", "--keep-fp32", "-q"]
    ref = CliRunner().invoke(cli, list(map(str, [*cmd, "-o", tmp_path / "ref"])))
    assert ref.exit_code == 0, ref.output
    reference = weights_of(tmp_path / "ref")
    assert len(reference) >= 3
    rng = random.Random(13)

    def merge_into(out: Path, hook: str | None = None, delay: float | None = None) -> tuple[int, float]:
        """The merge into ``out`` in a process of its own, killed by the kill hook at ``hook`` or by SIGKILL
        ``delay`` seconds after its start: its exit status and how long it ran."""
        start = time.monotonic()
        env = {**ENV, "PMAKIT_TEST_KILL": hook} if hook else ENV
        proc = subprocess.Popen(pmakit(*cmd, "-o", out), env=env, stderr=subprocess.DEVNULL)
        if delay is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(delay)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        return proc.wait(120), time.monotonic() - start

    # Moments: the kill hook's points (inside a shard, between shards, before the final rename) and 9 wall-clock
    # kills at random delays after start. A delay is drawn below the shortest run seen to finish first (2.5 s to
    # begin with), and a run that finished before its kill is checked and drawn again, so that a fast machine has
    # as many runs killed as a slow one.
    moments = ["in-shard:0", "after-shard:1", "after-shard:4", "in-shard:5", "before-rename", *[None] * 9]
    window, finished_first = 2.5, 0
    for k, hook in enumerate(moments):
        out = tmp_path / f"out{k}"
        if hook:
            rc, _ = merge_into(out, hook=hook)
        else:
            for _attempt in range(10):  # a hang guard only: each miss narrows the window to a run's length
                rc, took = merge_into(out, delay=rng.uniform(0.08, 1.0) * window)
                if rc != 0:
                    break
                finished_first += 1
                window = min(window, took)
                assert weights_of(out) == reference
                shutil.rmtree(out)
        assert rc == -9, (hook or f"no wall-clock kill in 10 runs ({finished_first} finished first)", rc)
        again = CliRunner().invoke(cli, list(map(str, [*cmd, "-o", out])))  # the very same command
        # killed after the output was in place: a clean refusal of a finished output; otherwise the same merge again
        if not (again.exit_code == 1 and "exists; pass --force" in again.stderr):
            assert again.exit_code == 0, (hook, again.output)
        assert weights_of(out) == reference, hook
        manifest_matches_bytes(out)
        assert not list(tmp_path.glob(f".out{k}*"))  # no partial output, old copy or lock file left


@pytest.mark.parametrize("how", ["TERM", "INT"])
def test_a_merge_stopped_by_a_signal_keeps_its_work_for_the_same_command(tmp_path: Path, how: str) -> None:
    """SIGTERM (torchrun stopping the other ranks when one dies; a scheduler's preemption) or Ctrl-C mid-merge:
    one line saying where the work is kept, nothing that looks finished, and the same command finishes it."""
    run = build_run(tmp_path)
    cmd = ["merge", run, "--last", "3", "--max-shard-size", "300KB", "-q"]
    ref = CliRunner().invoke(cli, list(map(str, [*cmd, "-o", tmp_path / "ref"])))
    assert ref.exit_code == 0, ref.output
    out = tmp_path / "out"
    env = {**ENV, "PMAKIT_TEST_KILL": "after-shard:2", "PMAKIT_TEST_KILL_SIGNAL": how}
    stopped = subprocess.run(
        pmakit(*cmd, "-o", out),
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        # A job a shell starts in the background ignores SIGINT (a CI runner may start the suite so), and a Python
        # started with SIGINT ignored never raises KeyboardInterrupt: restore it for the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    assert stopped.returncode != 0 and "Traceback" not in stopped.stderr, stderr_tail(stopped)
    partial = tmp_path / ".out.pmakit-partial"
    assert f"merge interrupted; what it wrote is kept in {partial}" in stopped.stderr, stderr_tail(stopped)
    assert not out.exists() and partial.is_dir()
    again = subprocess.run(pmakit(*cmd, "-o", out), env=ENV, capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0 and "continuing the interrupted merge" in again.stderr, stderr_tail(again)
    assert weights_of(out) == weights_of(tmp_path / "ref") and not partial.exists()
    manifest_matches_bytes(out)


def stderr_tail(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stderr[-3000:]


def test_concurrent_force_merges_into_one_output(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    out = tmp_path / "out"
    assert CliRunner().invoke(cli, ["merge", str(run), "--last", "2", "-o", str(out), "-q"]).exit_code == 0
    for trial in range(4):
        lasts = ("2", "4") if trial % 2 else ("4", "2")
        procs = [
            subprocess.Popen(
                pmakit("merge", run, "--last", n, "-o", out, "--force", "-q"),
                env=ENV,
                stderr=subprocess.PIPE,
                text=True,
            )
            for n in lasts
        ]
        results = [(p.wait(120), p.stderr.read() if p.stderr else "") for p in procs]
        assert any(rc == 0 for rc, _ in results), results
        for rc, err in results:
            assert rc == 0 or (rc == 1 and err.strip().startswith("Error: ") and "Traceback" not in err), err
        manifest = manifest_matches_bytes(out)
        # The weights are the merge of the window the manifest names.
        n = len(manifest["inputs"])
        alone = tmp_path / f"alone{trial}"
        assert (
            CliRunner().invoke(cli, ["merge", str(run), "--last", str(n), "-o", str(alone), "-q"]).exit_code
            == 0
        )
        assert weights_of(out) == weights_of(alone)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {e}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("keep_fp32", [False, True])
def test_disk_fills_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_fp32: bool) -> None:
    run = build_run(tmp_path)
    extra = ["--dtype", "bf16", "--keep-fp32"] if keep_fp32 else []
    args = ["merge", run, "--last", "3", "-o", None, "--max-shard-size", "600KB", "-q", *extra]
    with small_tmpfs(tmp_path / "disk", "1m") as disk:  # the output needs 2 MiB (bf16: 1 MiB + 2 MiB of sums)
        args[5] = disk / "out"
        # The free-space check refuses before writing anything ...
        r = CliRunner().invoke(cli, list(map(str, args)))
        assert r.exit_code == 1 and "not enough disk space" in r.stderr, r.output
        assert not any(disk.iterdir())
        # ... and when the disk fills up anyway (another writer), the merge stops with one line, no deadlock.

        import pmakit.merge

        real = shutil.disk_usage
        monkeypatch.setattr(pmakit.merge.output.shutil, "disk_usage", lambda p: real(p)._replace(free=2**40))
        faulthandler.dump_traceback_later(
            1800, exit=True
        )  # a deadlock: the stacks, not a suite waiting forever
        try:
            r = CliRunner().invoke(cli, list(map(str, args)))
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert r.exit_code == 1 and "disk full" in r.stderr and "Traceback" not in r.output, r.output
        assert not any(disk.iterdir())  # the partial output and the lock file are gone


# --- training -----------------------------------------------------------------------------------------------------

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(3000))


def train_config(tmp: Path) -> Path:
    corpus = tmp / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text(TEXT[i * 15000 : (i + 1) * 15000 + 40000])
    config = tmp / "c.yaml"
    config.write_text(
        "preset: smoke\ntrain:\n  corpus: " + str(corpus) + "\n  vocab_size: 300\n  val_fraction: 0.25\n"
        "  max_corpus_bytes: null\n  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}\n  batch_size: 4\n"
        "  total_tokens: 7680\n  warmup_tokens: 128\n  every_tokens: 384\n  eval_every: 2\n  eval_batches: 2\n"
        "  log_every: 1\n  threads: 1\n"
    )
    return config


@pytest.mark.slow
def test_train_killed_at_random_moments_then_resumed(tmp_path: Path) -> None:
    config = train_config(tmp_path)
    env = {**ENV, "PMAKIT_CACHE": str(tmp_path / "cache")}
    reference = run_cli("train", config, "-o", tmp_path / "ref", env=env)
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    metrics = run / "metrics.jsonl"
    rng = random.Random(11)
    kills = 0
    for _ in range(10):
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        wait_for = lines + rng.randint(1, 6)  # kill once this many more records are written
        proc = subprocess.Popen(
            pmakit("train", config, "-o", run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 1800
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= wait_for:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
        kills += proc.wait(60) == -9
    final = run_cli("train", config, "-o", run, env=env)
    assert final.returncode == 0, final.stderr
    assert kills >= 10
    records = read_metrics(run)
    train = [r["step"] for r in records if r["kind"] == "train"]
    assert train == sorted(set(train)) and train[0] == 1 and train[-1] == 60, (
        train
    )  # each step once, in order
    times = [r["time"] for r in records]
    assert times == sorted(times)  # the clock continues across resumes
    evals = [(r.get("model"), r["step"]) for r in records if r["kind"] == "eval"]
    assert len(evals) == len(set(evals))
    # The results: the uninterrupted run's final weights and snapshots.
    ref_snaps = sorted(p.name for p in (tmp_path / "ref" / "snapshots").iterdir())
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ref_snaps
    a = load_file(tmp_path / "ref" / "snapshots" / ref_snaps[-1] / "model.safetensors")
    b = load_file(run / "snapshots" / ref_snaps[-1] / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
