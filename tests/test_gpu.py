"""The CUDA paths, on a real GPU: the saver's pinned asynchronous copy on a side stream while training goes on, the
online averager fed from and swapped into a GPU model, and `pmakit merge --device cuda` alone and under torchrun
(NCCL). Skipped where there is no CUDA device (the development and CI machines); run on a GPU machine with
`python -m pytest tests/test_gpu.py` (docs/gpu.md says what ran where)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import pmakit.merge as merge_mod
from conftest import SRC, run_cli, state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.layouts import open_weights
from pmakit.merge import MergePlan, plan_merge
from pmakit.merge.stream import stream_average
from pmakit.online import OnlineAverager
from pmakit.saver import SnapshotSaver
from pmakit.snapshot import discover

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_SHAPES = {
    "embed.weight": (4096, 1024),
    "layers.0.mlp.weight": (4096, 4096),
    "layers.0.norm.weight": (1024,),
    "head.weight": (4096, 1024),
}


def test_every_snapshot_holds_the_weights_of_its_step_while_kernels_keep_running(tmp_path: Path) -> None:
    """Each save's copy runs on a side stream into pinned memory while the compute stream is already changing the
    weights again (large in-place kernels queued right after the call): every snapshot must hold exactly the
    weights of its step, never a mix of two steps."""
    torch.manual_seed(0)
    params = {k: torch.randn(s, device="cuda") for k, s in GPU_SHAPES.items()}
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with SnapshotSaver(tmp_path, every_tokens=1, fsync=False) as saver:
        for step in range(1, 7):
            for t in params.values():
                t.mul_(1.01).add_(0.5)  # "training": queued kernels, not yet run when save is called
            saver.maybe_save(params, tokens=step, step=step)
            expected[step] = {k: v.cpu() for k, v in params.items()}  # the values at this step (synchronises)
            for _ in range(20):  # a long tail of kernels racing the copy of this step's weights
                for t in params.values():
                    t.add_(1.0)
            for t in params.values():
                t.sub_(20.0)
    for step, want in expected.items():
        got = load_file(tmp_path / f"step-{step:08d}" / "model.safetensors")
        for k, v in want.items():
            assert torch.equal(got[k], v), (step, k)


def test_online_averager_from_a_gpu_model_and_swapped_into_it(tmp_path: Path) -> None:
    """The averager keeps its fp32 sums on the host from GPU weights; swapped into the GPU model it gives the
    window's average, and the model's own weights come back bit for bit."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    avg = OnlineAverager(n=3, method="sma", hold_in_memory=True)
    seen = []
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        seen.append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        avg.update(model.state_dict(), tokens=step)
    want = {k: torch.stack([s[k].float() for s in seen[-3:]]).mean(0) for k in seen[-1]}
    for k, v in avg.average().items():
        assert v.device.type == "cpu" and torch.allclose(v, want[k], atol=1e-6), k
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 256, device="cuda")
    with avg.swapped_in(model), torch.no_grad():
        for k, v in model.state_dict().items():
            assert v.is_cuda and torch.allclose(v.cpu(), want[k], atol=1e-6), k
        y = model(x)
    assert torch.isfinite(y).all()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _run(tmp_path: Path, n: int = 4) -> Path:
    run = tmp_path / "run"
    shapes = {k: (s[0] // 4, *s[1:]) for k, s in GPU_SHAPES.items()}
    for i in range(1, n + 1):
        write_snapshot(run / f"step-{i * 10:06d}", state(i, shapes=shapes), step=i * 10, tokens=i * 100)
    return run


def _merged(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_merge_on_the_gpu_matches_the_cpu_merge(tmp_path: Path) -> None:
    """`--device cuda` folds each chunk on the GPU in fp32: the bf16 output is the CPU merge's, to within one bf16
    rounding step where the two fp32 sums differ in their last bit."""
    run = _run(tmp_path)
    for device in ("cpu", "cuda"):
        r = run_cli(
            "merge", run, "--method", "ema", "--alpha", "0.3", "-o", tmp_path / device, "--device", device
        )
        assert r.returncode == 0, r.stderr[-2000:]
        # The user's --device cuda stands, with one line on what was measured (the CPU fold is not told anything).
        notes = [line for line in r.stderr.splitlines() if line.startswith("info: --device cuda: ")]
        assert len(notes) == (1 if device == "cuda" else 0), r.stderr
        assert all(
            "the GPU fold measured within the CPU fold's run-to-run spread" in note for note in notes
        ), notes
    cpu, gpu = _merged(tmp_path / "cpu"), _merged(tmp_path / "cuda")
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        assert cpu[k].dtype == gpu[k].dtype, k
        if cpu[k].is_floating_point():
            diff = (cpu[k].float() - gpu[k].float()).abs()
            assert (diff <= cpu[k].float().abs() * 2**-7 + 1e-30).all(), k  # one bf16 ulp at most
        else:
            assert torch.equal(cpu[k], gpu[k]), k


def _stream(plan: MergePlan, out: Path, device: str) -> dict[str, torch.Tensor]:
    """The engine's streaming pass alone, on ``device``."""
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_weights(s.path)) for s in plan.snapshots]
        out.mkdir()
        stream_average(plan, readers, out, None, False, device=device)
    return _merged(out)


def test_the_gpu_fold_reuses_its_buffers_without_mixing_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """About 2,300 chunks of 4096 elements, 4 inputs each, through 3 workers and 6 pinned staging buffers: a buffer
    refilled before its copy reached the GPU, or overwritten on the GPU before its fold, would mix chunks. The output
    is the CPU fold's to within one bf16 rounding step; a NaN in one input is still found and named."""
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 4096)
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", "3")
    run = _run(tmp_path)
    plan = plan_merge(discover(run), [0.1, 0.2, 0.3, 0.4])
    assert plan.fold.workers == 3 and plan.chunk_elems == 4096
    cpu, gpu = _stream(plan, tmp_path / "cpu", "cpu"), _stream(plan, tmp_path / "cuda", "cuda")
    assert cpu.keys() == gpu.keys()
    for k in cpu:
        if cpu[k].is_floating_point():
            diff = (cpu[k].float() - gpu[k].float()).abs()
            assert (diff <= cpu[k].float().abs() * 2**-7 + 1e-30).all(), k  # one bf16 ulp at most
        else:
            assert torch.equal(cpu[k], gpu[k]), k
    shapes = {k: (s[0] // 4, *s[1:]) for k, s in GPU_SHAPES.items()}
    bad = state(2, shapes=shapes)
    bad["layers.0.mlp.weight"].view(-1)[123_456] = float("nan")
    write_snapshot(tmp_path / "nan" / "step-000010", state(1, shapes=shapes), step=10, tokens=100)
    write_snapshot(tmp_path / "nan" / "step-000020", bad, step=20, tokens=200)
    plan = plan_merge(discover(tmp_path / "nan"), [0.5, 0.5])
    with pytest.raises(PmakitError, match="non-finite values.*layers.0.mlp.weight.*step-000020"):
        _stream(plan, tmp_path / "nan-out", "cuda")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(_free_port()), "-m", "pmakit", "merge", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)


def test_torchrun_merge_on_the_gpus_writes_the_single_process_bytes(tmp_path: Path) -> None:
    """The real entry point under torchrun with --device cuda, one rank per GPU (NCCL from two GPUs on): the
    output is byte for byte the single-process GPU merge's. With one GPU, asking for two ranks is one line."""
    run = _run(tmp_path)
    r = run_cli("merge", run, "-o", tmp_path / "one", "--device", "cuda")
    assert r.returncode == 0, r.stderr[-2000:]
    gpus = torch.cuda.device_count()
    r = _torchrun(min(gpus, 2), run, "-o", tmp_path / "ranks", "--device", "cuda")
    assert r.returncode == 0, r.stderr[-3000:]
    for f in (tmp_path / "one").iterdir():
        if f.name != "pmakit-merge.json":
            assert f.read_bytes() == (tmp_path / "ranks" / f.name).read_bytes(), f.name
    if gpus == 1:
        r = _torchrun(2, run, "-o", tmp_path / "two", "--device", "cuda")
        assert r.returncode != 0 and not (tmp_path / "two").exists()
        assert "Error: --device cuda: local rank 1 needs GPU 1, but this machine has 1" in r.stderr, r.stderr[
            -3000:
        ]
