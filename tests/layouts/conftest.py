"""Checkpoints written by the real frameworks' own trainers (CPU, gloo), once per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def run_framework(
    script: Path, *args: str | Path, ranks: int = 1, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a framework driver script (``torchrun`` for ``ranks > 1``); fail the test with its output tail."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(
        [*launcher, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{script.name} {' '.join(map(str, args))} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def olmo_core_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """OLMo-core save folders: ``ws1`` (10 steps, a checkpoint every step, plus OLMo-core's own
    ``step3-merged``), and ``ws2``: its last 4 checkpoints loaded and saved again by OLMo-core under FSDP over 2
    ranks (the same weights, sharded)."""
    pytest.importorskip("olmo_core")
    root = tmp_path_factory.mktemp("olmo_core")
    script = HERE / "olmo_core_run.py"
    run_framework(script, "train", root / "ws1" / "save", 10)
    run_framework(script, "reshard", root / "ws1" / "save", root / "ws2" / "save", 4, ranks=2)
    return {"ws1": root / "ws1" / "save", "ws2": root / "ws2" / "save", "root": root}


@pytest.fixture(scope="session")
def olmo_core_callback_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """pmakit's PMACallback on OLMo-core's Trainer, 8 steps: ``full`` uninterrupted; ``resumed`` killed after
    step 5 (its last checkpoint is step 4) and resumed by the Trainer; ``ws2`` under FSDP over 2 ranks. Each has
    ``save`` (OLMo-core's checkpoints) and ``pma`` (pmakit's snapshots and metrics.jsonl)."""
    pytest.importorskip("olmo_core")
    root = tmp_path_factory.mktemp("olmo_core_callback")
    script = HERE / "olmo_core_run.py"
    runs = {name: root / name for name in ("full", "resumed", "ws2")}
    run_framework(script, "callback", runs["full"] / "save", runs["full"] / "pma", 8)
    crashed = subprocess.run(
        [
            sys.executable,
            str(script),
            "callback",
            runs["resumed"] / "save",
            runs["resumed"] / "pma",
            "8",
            "5",
        ],
        capture_output=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(SRC)},
        timeout=300,
    )
    assert crashed.returncode == 17, crashed.stderr[-3000:]  # the Crash callback's os._exit
    run_framework(script, "callback", runs["resumed"] / "save", runs["resumed"] / "pma", 8)
    run_framework(script, "callback", runs["ws2"] / "save", runs["ws2"] / "pma", 8, ranks=2)
    return runs
