"""Model copies under torchrun (gloo, 2 processes): synchronous data parallel, local SGD, DiLoCo, resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, run_cli
from pmakit.formats import read_state

CONFIG = """
train:
  corpus: null
  max_corpus_bytes: 300000
  vocab_size: 300
  val_fraction: 0.2
  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}
  batch_size: 4
  total_tokens: TOTAL
  lr: 0.05
  optimizer: OPT
  precision: fp32            # the identities below are exact in fp32 (bf16 rounding would part the two ways)
  warmup_tokens: 0
  grad_clip: 0
  every_tokens: 1280
  average_last: 2
  eval_every: 1
  eval_batches: 2
  seed: 0
"""

ENV = cli_env()
"""The copies run this checkout's sources, not an installed pmakit."""


def _config(tmp: Path, name: str, total: int = 2560, optimizer: str = "sgd") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.replace("TOTAL", str(total)).replace("OPT", optimizer))
    return path


def _torchrun(config: Path, out: Path, *args: str) -> str:
    env = {**ENV, "PMAKIT_CACHE": os.environ.get("PMAKIT_CACHE", "")}
    env = {k: v for k, v in env.items() if v}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "pmakit", "train", str(config), "-o", str(out), "--replicas", "2", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return read_state(run / "snapshots" / f"step-{step:08d}")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synchronous data parallel under torchrun (plain SGD, 2 copies): the run two tests compare with."""
    tmp = tmp_path_factory.mktemp("synchronous")
    _torchrun(_config(tmp, "sgd"), tmp / "run", "--sync", "gradients")
    return tmp / "run"


@pytest.mark.slow
def test_local_sgd_with_h1_equals_synchronous_data_parallel(synchronous: Path, tmp_path: Path) -> None:
    # With plain SGD, averaging the copies after every step is the all-reduced gradient step:
    # mean_r(p - lr g_r) = p - lr mean_r(g_r).
    _torchrun(_config(tmp_path, "sgd"), tmp_path / "local", "--sync-every", "1")
    sync, local = _weights(synchronous, 10), _weights(tmp_path / "local", 10)
    assert _max_diff(sync, local) < 1e-6
    assert _max_diff(sync, _weights(synchronous, 5)) > 1e-3  # the model did move


@pytest.mark.slow
def test_diloco_with_unit_outer_sgd_is_local_sgd_and_resumes_exactly(tmp_path: Path) -> None:
    # Outer SGD with lr 1 and no momentum: global - mean(global - local) = mean(local), local SGD's average.
    sgd = _config(tmp_path, "sgd")
    _torchrun(sgd, tmp_path / "local", "--sync-every", "5")
    _torchrun(
        sgd,
        tmp_path / "unit",
        "--sync-every",
        "5",
        "--outer",
        "sgd",
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
    )
    assert _max_diff(_weights(tmp_path / "local", 10), _weights(tmp_path / "unit", 10)) < 1e-6
    cfg = _config(tmp_path, "adam", optimizer="adamw")
    # Nesterov DiLoCo stopped half-way and resumed equals the straight run (inner and outer states restored).
    diloco = ("--sync-every", "5", "--outer", "nesterov", "--save-replicas")
    _torchrun(cfg, tmp_path / "straight", *diloco)
    _torchrun(_config(tmp_path, "half", total=1280, optimizer="adamw"), tmp_path / "resumed", *diloco)
    again = _torchrun(cfg, tmp_path / "resumed", *diloco)
    # continued from the half run's checkpoint
    assert "resumed " in again and "(step 5)" in again, again[-3000:]
    straight, resumed = _weights(tmp_path / "straight", 10), _weights(tmp_path / "resumed", 10)
    assert _max_diff(straight, resumed) == 0.0
    # Each copy's own pre-sync weights were kept. They differ, and their average is not the global model the
    # sync made of them: Nesterov's outer step is not plain averaging, which would give that average exactly.
    copies = [
        read_state(next((tmp_path / "straight" / "replicas" / f"rank-{r}" / "snapshots").glob("step-*10")))
        for r in (0, 1)
    ]
    assert _max_diff(copies[0], copies[1]) > 1e-4
    average = {k: (copies[0][k].double() + copies[1][k].double()) / 2 for k in straight}  # lm_head: tied
    assert _max_diff(straight, average) > 1e-3
    # `pmakit merge` across copies and time: --last 4 of two copies = both copies at the last two snapshots.
    ranks = [tmp_path / "straight" / "replicas" / f"rank-{r}" / "snapshots" for r in (0, 1)]
    done = _pmakit(
        "merge", *map(str, ranks), "-o", str(tmp_path / "across"), "--last", "4", "--dtype", "fp32"
    )
    assert done.returncode == 0, done.stderr
    members = [read_state(d) for r in ranks for d in sorted(r.glob("step-*"))]
    assert len(members) == 4
    expected = {k: torch.stack([m[k].double() for m in members]).mean(0) for k in members[0]}
    assert _max_diff(read_state(tmp_path / "across"), expected) < 1e-6


def _pmakit(*args: str, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``pmakit ARGS``; ``tmp``: its TMPDIR (made here)."""
    if tmp is None:
        return run_cli(*args)
    tmp.mkdir(exist_ok=True)
    return run_cli(*args, env={"TMPDIR": str(tmp)})


def test_replicas_without_torchrun_launch_their_own_processes(synchronous: Path, tmp_path: Path) -> None:
    sgd = _config(tmp_path, "sgd")
    own = ("train", str(sgd), "-o", str(tmp_path / "own"), "--replicas", "2", "--sync", "gradients")
    done = _pmakit(*own, tmp=tmp_path / "tmp")
    assert done.returncode == 0, done.stderr[-3000:]
    # the same run under torchrun
    assert _max_diff(_weights(tmp_path / "own", 10), _weights(synchronous, 10)) == 0.0
    # torch's agent's folder (each copy's error file) is gone with the run, not left in TMPDIR
    assert not any((tmp_path / "tmp").iterdir())


def test_replica_mistakes_are_one_line_and_write_nothing(tmp_path: Path) -> None:
    # V = 1280 tokens is not a multiple of 3 steps x 2 copies x 128 tokens: refused before any process starts.
    out = tmp_path / "r"
    done = _pmakit(
        "train", str(_config(tmp_path, "c")), "-o", str(out), "--replicas", "2", "--sync-every", "3"
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip().splitlines()[0]]
    assert done.stderr.startswith("Error: snapshot and checkpoint intervals (1,280 tokens)")
    assert not out.exists()
    # A failure inside one copy (a corpus that does not exist): its error, the other copy's one line, no traceback.
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(_config(tmp_path, "d").read_text().replace("corpus: null", "corpus: /nonexistent/corpus"))
    done = _pmakit("train", str(cfg), "-o", str(out), "--replicas", "2", tmp=tmp_path / "tmp")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "Error: corpus not found: /nonexistent/corpus" in done.stderr
    assert "Error: model copy 0 of 2 failed" in done.stderr
    assert not any((tmp_path / "tmp").iterdir())  # the failed run's agent folder is gone too


def test_bad_replica_options_are_refused() -> None:
    from pmakit.errors import PmakitError
    from pmakit.train.replicas import ReplicaConfig

    with pytest.raises(PmakitError, match="sync=gradients"):
        ReplicaConfig(sync="gradients", sync_every=10)
    with pytest.raises(PmakitError, match="outer"):
        ReplicaConfig(outer="adam")


@pytest.mark.slow
def test_replicas_study_smoke_preset_end_to_end(tmp_path: Path) -> None:
    import json

    run = tmp_path / "study"
    cmd = ("experiment", "--preset", "replicas-smoke", "-o", str(run))
    done = run_cli(*cmd, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    by = {(r["arm"], r["model"]): r for r in rows}
    # 160 optimizer steps of 512 tokens (2 copies x 4 x 64): one all-reduce per step, per H = 4 steps, none alone.
    assert by[("sync", "latest")]["all_reduces"] == 160
    assert by[("local-H4", "latest")]["all_reduces"] == 40
    assert by[("single", "latest")]["all_reduces"] == 0
    assert ("diloco-H4", "pma4-copies") in by  # kept per-copy snapshots: PMA across copies and time
    assert by[("sync", "latest")]["delta_vs_sync"] == 0.0
    assert all(len(r["batch_losses"]) == 4 for r in rows)
    report = (run / "report.md").read_text()
    assert "the 2% target" in report and "plots/replicas.png" in report
    # Re-running resumes: nothing is trained again, the scores are the same.
    again = run_cli(*cmd, timeout=1800)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already trained" in again.stderr
    assert [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()] == rows


def test_report_of_an_unfinished_replicas_study_is_one_line(tmp_path: Path) -> None:
    from conftest import run_cli

    (tmp_path / "experiment.json").write_text('{"study": "replicas"}')
    proc = run_cli("report", tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip()
        == f"Error: {tmp_path} has no scores yet (results.jsonl, curves.csv): run the study to its end first"
    )


def test_a_finished_run_tears_down_only_the_process_group_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that exits with a gloo group up can abort at interpreter exit ("terminate called without an active
    exception"): the copies that ``from_env`` joined into a group take it down after a clean run; a group someone
    else started (torchrun's caller, a test) is left to its owner."""
    import torch.distributed as dist

    from pmakit.train.replicas import ReplicaConfig, Replicas, from_env

    monkeypatch.setenv("WORLD_SIZE", "2")  # from_env's check; the group itself is one process here
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        joined = from_env(ReplicaConfig(sync_every=4))
        assert isinstance(joined, Replicas) and not joined.owns_group
        joined.finish()
        assert dist.is_initialized()  # not ours: left up
        Replicas(ReplicaConfig(sync_every=4), owns_group=True).finish()  # as when from_env started it
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_failure_line_names_the_copy_that_failed_first() -> None:
    """Copy 1 killed at start-up, copy 0 then stopped by the launcher's SIGTERM: the line named copy 0 ('exit 143;
    its error is printed above': the wrong copy, and nothing was printed)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from pmakit.train.launch import failure_line

    def failed(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="/nonexistent")

    killed = {0: failed(0, 143), 1: failed(1, -9)}
    assert failure_line(killed, 2) == "model copy 1 of 2 was killed by SIGKILL"
    erred = {0: failed(0, -15), 1: failed(1, 1)}
    assert failure_line(erred, 2) == "model copy 1 of 2 failed (exit 1); its error is printed above"
    both_stopped = {0: failed(0, -15), 1: failed(1, -15)}
    assert failure_line(both_stopped, 2) == "model copy 0 of 2 was killed by SIGTERM"
    # A copy that lost the others (exit 3) is never the one named while another ended otherwise.
    lost = {0: failed(0, 3), 1: failed(1, -9)}
    assert failure_line(lost, 2) == "model copy 1 of 2 was killed by SIGKILL"
    termed = {0: failed(0, 3), 1: failed(1, 143)}
    assert failure_line(termed, 2) == "model copy 1 of 2 was stopped by SIGTERM"
    # Copy 1 killed, copy 0's collective aborted in C++ (SIGABRT) before the launcher stopped it: copy 1 is named.
    aborted = {0: failed(0, -6), 1: failed(1, -9)}
    assert failure_line(aborted, 2) == "model copy 1 of 2 was killed by SIGKILL"
    crashed = {0: failed(0, -15), 1: failed(1, -11)}
    assert failure_line(crashed, 2) == "model copy 1 of 2 was killed by SIGSEGV"
    everyone_lost = {0: failed(0, 3), 1: failed(1, 3)}
    assert (
        failure_line(everyone_lost, 2)
        == "model copy 0 of 2 stopped: a collective with the other copies failed"
    )


@pytest.mark.parametrize("stop", ["launcher", "copy"])
def test_a_run_stopped_by_a_signal_ends_with_one_line(tmp_path: Path, stop: str) -> None:
    """SIGTERM to the `pmakit train --replicas 2` launcher while its copies train (torch's agent raised
    SignalException: a traceback), or SIGKILL to copy 1 (copy 0's failed all-reduce printed its "[rank0]:"
    traceback whenever it noticed before the launcher stopped it): one line, a non-zero exit, no traceback of any
    process, whichever process sees the failure first."""
    import signal
    import time

    import psutil

    config = _config(tmp_path, "long", total=2560 * 400)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pmakit", "train", str(config), "-o", str(out), "--replicas", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 1800  # a hang guard only
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and '"train"' in metrics.read_text():
            break  # the copies are training
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if stop == "launcher":
        proc.send_signal(signal.SIGTERM)
    else:
        copies = {c.environ().get("RANK"): c for c in psutil.Process(proc.pid).children()}
        copies["1"].send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=1800)
    assert "Traceback" not in stderr and "[rank" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith(("Error", "stopped"))]
    if stop == "launcher":
        assert proc.returncode == 143 and errors == ["stopped by SIGTERM: the model copies were stopped"], (
            stderr
        )
    else:
        assert proc.returncode == 1 and errors == ["Error: model copy 1 of 2 was killed by SIGKILL"], stderr


def test_replicas_study_refuses_another_config_before_training(tmp_path: Path) -> None:
    # The run directory's config stamp: arms trained under one config are not scored as another's (the study
    # stamped nothing and went on training and scoring the old arms).
    from conftest import run_cli

    run = tmp_path / "study"
    (run / "arms").mkdir(parents=True)
    (run / "config.json").write_text('{"train": {}, "replicas": {}}\n')
    done = run_cli("experiment", "--preset", "replicas-smoke", "-o", run, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {run} holds a study with another config"), lines
    assert "pass --fresh to start over" in lines[0]
    assert sorted(p.name for p in run.iterdir()) == ["arms", "config.json"]
