"""``pmakit train --replicas 2 --backend torchft``: real torchft (lighthouse, Managers, gloo) in real processes.

A copy killed with SIGKILL mid-run is restarted by the launcher, healed from the live copy, and the run finishes;
snapshots are only ever of the synced model. With no failure, torchft's local SGD is the torch backend's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pmakit.formats import read_state

pytest.importorskip("torchft")
psutil = pytest.importorskip("psutil")

CONFIG = """
train:
  corpus: null
  max_corpus_bytes: 300000
  vocab_size: 300
  val_fraction: 0.2
  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}
  batch_size: 4
  total_tokens: TOTAL
  lr: 0.01
  optimizer: adamw
  warmup_tokens: 0
  grad_clip: 0
  every_tokens: 1280
  average_last: 2
  eval_every: 4
  eval_batches: 2
  seed: 0
"""
H = 5  # 1280 tokens = 5 steps x 2 copies x 128 tokens


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def _cmd(config: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pmakit", "train", str(config), "-o", str(out), "--replicas", "2", *args]


def _config(tmp: Path, total: int) -> Path:
    path = tmp / "cfg.yaml"
    path.write_text(CONFIG.replace("TOTAL", str(total)))
    return path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _max_step(path: Path) -> int:
    if not path.exists():
        return 0
    return max((r.get("step", 0) for r in _records(path) if r.get("kind") == "train"), default=0)


def _copy_pid(launcher: int, copy: int) -> int:
    for child in psutil.Process(launcher).children():
        try:
            if child.environ().get("PMAKIT_FT_REPLICA") == str(copy):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"copy {copy} not found")


def _slow_down_until_back(
    proc: subprocess.Popen, survivor: int, watched: Path, killed_at: int, dead: int
) -> None:
    """Pause the surviving copy for 0.5 s in every 0.6 s (well inside torchft's 5 s heartbeat timeout) until the
    restarted copy trains again, so that the survivor cannot finish the run alone while the restart is slow (a
    loaded machine): the test is about healing, not about which process is faster to start."""
    pid = _copy_pid(proc.pid, survivor)
    deadline = time.monotonic() + 1800
    try:
        while _max_step(watched) <= killed_at:
            assert proc.poll() is None and time.monotonic() < deadline, "the killed copy did not come back"
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.5)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert _copy_pid(proc.pid, 1 - survivor) != dead


@pytest.mark.parametrize("victim", [1, 0], ids=["copy-1", "writer"])
def test_a_killed_copy_is_restarted_healed_and_the_run_finishes(tmp_path: Path, victim: int) -> None:
    total = 51200  # 200 steps of both copies: the survivor is still training when the restarted copy is back
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(_config(tmp_path, total), out, "--backend", "torchft", "--sync-every", str(H)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watched = out / "metrics.jsonl" if victim == 0 else out / "replicas" / f"rank-{victim}" / "metrics.jsonl"
    deadline = time.monotonic() + 1800
    while _max_step(watched) < 30:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    dead = _copy_pid(proc.pid, victim)
    os.kill(dead, signal.SIGKILL)
    with contextlib.suppress(psutil.NoSuchProcess):  # gone (reaped by the launcher): it writes no more
        psutil.wait_procs([psutil.Process(dead)], timeout=60)
    # Read once the copy is gone: read before the kill, a step it wrote meanwhile ended the wait below at once.
    killed_at = _max_step(watched)
    _slow_down_until_back(proc, 1 - victim, watched, killed_at, dead)
    stdout, stderr = proc.communicate(timeout=1800)

    assert proc.returncode == 0, stderr[-3000:]
    assert f"copy {victim} was killed (SIGKILL); restarting it" in stderr
    assert f"copy {victim} healed from a live copy" in stderr
    assert "Traceback" not in stderr
    trained = int(stdout.split("trained ")[1].split(" tokens")[0].replace(",", ""))
    assert trained >= total
    # Snapshots only of the synced model, tokens rising, none half-written; the healed copy went on training.
    snaps = [r for r in _records(out / "metrics.jsonl") if r["kind"] == "snapshot"]
    assert len(snaps) >= 20 and snaps[-1]["tokens"] > total - 1280 and all(r["step"] % H == 0 for r in snaps)
    assert [r["tokens"] for r in snaps] == sorted({r["tokens"] for r in snaps})
    assert not list((out / "snapshots").glob(".*partial*"))
    assert _max_step(out / "replicas" / "rank-1" / "metrics.jsonl") >= 200
    merged = subprocess.run(
        [
            sys.executable,
            "-m",
            "pmakit",
            "merge",
            str(out / "snapshots"),
            "-o",
            str(tmp_path / "merged"),
            "--last",
            "4",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert merged.returncode == 0, merged.stderr


def test_with_no_failure_torchft_local_sgd_is_the_torch_backends(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 6400)
    for backend in ("torch", "torchft"):
        done = subprocess.run(
            _cmd(cfg, tmp_path / backend, "--backend", backend, "--sync-every", str(H)),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    for step in (10, 25):
        a = read_state(tmp_path / "torch" / "snapshots" / f"step-{step:08d}")
        b = read_state(tmp_path / "torchft" / "snapshots" / f"step-{step:08d}")
        assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) < 1e-6
    first = read_state(tmp_path / "torchft" / "snapshots" / f"step-{5:08d}")
    assert max((first[k] - b[k]).abs().max().item() for k in b) > 1e-3  # the model did move


def test_torchft_refuses_gradient_sync_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        _cmd(_config(tmp_path, 12800), tmp_path / "run", "--backend", "torchft", "--sync", "gradients"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: --backend torchft syncs weights (local SGD / DiLoCo); --sync gradients runs on --backend torch"
    ]
    assert not (tmp_path / "run").exists()


def test_a_crashed_run_resumes_with_the_same_command(tmp_path: Path) -> None:
    total = 25600  # 100 steps of both copies
    out = tmp_path / "run"
    cmd = _cmd(_config(tmp_path, total), out, "--backend", "torchft", "--sync-every", str(H))
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.monotonic() + 1800
    while _max_step(out / "metrics.jsonl") < 20:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its lighthouse and both copies at once
    proc.wait()
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stderr and f"trained {total:,} tokens (100 steps)" in done.stdout
    snaps = [r["step"] for r in _records(out / "metrics.jsonl") if r["kind"] == "snapshot"]
    assert snaps == list(range(H, 101, H))  # every snapshot once: none lost, none written twice
