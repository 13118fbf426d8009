import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import pmakit.saver as saver_mod
from conftest import SRC, state
from pmakit.errors import PmakitError
from pmakit.saver import SaverTimings, SnapshotSaver, cpu_copy
from pmakit.snapshot import Snapshot, discover, read_snapshot, write_metadata
from pmakit.train.averaging import Averaging


def load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", framework="pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118


def run_batches(saver: SnapshotSaver, batch_tokens: list[int], model: dict[str, torch.Tensor]) -> list[int]:
    """Feed batches of the given sizes; the token counts at which a snapshot was saved."""
    tokens, saved = 0, []
    for step, n in enumerate(batch_tokens, start=1):
        tokens += n
        if saver.maybe_save(model, tokens=tokens, step=step) is not None:
            saved.append(tokens)
    saver.wait()
    return saved


@pytest.mark.parametrize("background", [False, True])
def test_saves_at_each_crossed_multiple_of_v(tmp_path: Path, background: bool) -> None:
    saver = SnapshotSaver(tmp_path / "run", 100, background=background)
    # Variable batches: 30 -> 100 (hits 100 exactly) -> 150 -> 260 (crosses 200) -> 450 (crosses 300 AND 400:
    # one save) -> 499 -> 500 -> 520.
    saved = run_batches(saver, [30, 70, 50, 110, 190, 49, 1, 20], state(0))
    assert saved == [100, 260, 450, 500]
    found = discover(tmp_path / "run")
    assert [s.tokens for s in found] == [100, 260, 450, 500]
    assert [s.path.name for s in found] == [
        "step-00000002",
        "step-00000004",
        "step-00000005",
        "step-00000007",
    ]


def test_due_is_relative_to_start_tokens_on_resume(tmp_path: Path) -> None:
    saver = SnapshotSaver(tmp_path, 100, start_tokens=250)
    # Resumed at 250: 200 was saved before the crash, the next multiple is 300.
    assert not saver.due(250) and not saver.due(299)
    assert saver.due(300)
    exact = SnapshotSaver(tmp_path, 100, start_tokens=300)
    assert not exact.due(399) and exact.due(400)


def test_state_dict_round_trip_continues_the_schedule(tmp_path: Path) -> None:
    a = SnapshotSaver(tmp_path / "a", 100, background=False)
    assert run_batches(a, [60, 60, 60], state(0)) == [120]
    b = SnapshotSaver(tmp_path / "b", 100, background=False)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert not b.due(199) and b.due(200)


def test_snapshot_format_and_copy_at_call(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    model = nn.Linear(4, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saver = SnapshotSaver(
        tmp_path / "run", 10, extra_files=[config], extra_text={"generation_config.json": "{}"}
    )
    snap = saver.maybe_save(model, tokens=10, step=1, lr=0.5, loss=2.25, note="x")
    assert snap is not None
    with torch.no_grad():  # training goes on while the write runs: the snapshot keeps the values at the call
        for p in model.parameters():
            p.add_(1.0)
    saver.wait()
    got = load(snap.path)
    assert got.keys() == before.keys()
    for k in before:
        assert torch.equal(got[k], before[k])
    assert sorted(p.name for p in snap.path.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "pmakit.json",
    ]
    read = read_snapshot(snap.path)
    assert (read.step, read.tokens, read.lr, read.loss, read.meta["note"]) == (1, 10, 0.5, 2.25, "x")
    with safe_open(snap.path / "model.safetensors", framework="pt") as h:
        assert h.metadata() == {"format": "pt"}  # from_pretrained refuses files without it


def test_dtype_cast_and_sharding(tmp_path: Path) -> None:
    tensors = state(1, torch.float32)
    saver = SnapshotSaver(tmp_path, 1, dtype=torch.bfloat16, max_shard_size=5000, background=False)
    snap = saver.save(tensors, tokens=1, step=1)
    index = json.loads((snap.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert [s.tokens for s in discover(tmp_path)] == [1]
    with safe_open(snap.path / index["weight_map"]["embed.weight"], framework="pt") as h:
        assert torch.equal(h.get_tensor("embed.weight"), tensors["embed.weight"].to(torch.bfloat16))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_saved_once(tmp_path: Path) -> None:
    model = Tied()
    copy, tied = cpu_copy(model)
    assert list(copy) == ["embed.weight"] and tied == {"head.weight": "embed.weight"}
    snap = SnapshotSaver(tmp_path, 1, background=False).save(model, tokens=1, step=1)
    assert list(load(snap.path)) == ["embed.weight"]
    assert read_snapshot(snap.path).meta["tied"] == {"head.weight": "embed.weight"}


def test_retention_keeps_last_k_and_nothing_else_is_touched(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-99999999").mkdir()  # looks like ours by name, but has no pmakit.json: not a snapshot
    (run / "step-99999999" / "model.safetensors").write_bytes(b"")
    (run / "notes").mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    merged = run / "merged"
    merged.mkdir()
    write_metadata(merged, step=0, tokens=0)  # a pmakit snapshot, but not named by the saver
    present_at_callback: list[list[str]] = []

    def on_save(snapshot: Snapshot, tensors: dict[str, torch.Tensor]) -> None:
        present_at_callback.append(sorted(p.name for p in run.glob("step-0*")))

    saver = SnapshotSaver(run, 10, keep_last=2, on_save=[on_save])
    assert run_batches(saver, [10] * 5, state(0)) == [10, 20, 30, 40, 50]
    assert sorted(p.name for p in run.iterdir()) == [
        "merged",
        "metrics.jsonl",
        "notes",
        "step-00000004",
        "step-00000005",
        "step-99999999",
    ]
    # The callback of snapshot 3 still sees snapshot 1: deletion comes after the new one and its callbacks.
    assert present_at_callback[2] == ["step-00000001", "step-00000002", "step-00000003"]


def test_resaving_a_step_replaces_it_atomically(tmp_path: Path) -> None:
    saver = SnapshotSaver(tmp_path, 10, background=False)
    saver.save(state(1), tokens=10, step=1)
    saver.save(state(2), tokens=10, step=1)
    assert torch.equal(load(tmp_path / "step-00000001")["embed.weight"], state(2)["embed.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "step-00000002").mkdir()  # not a snapshot: never replaced
    with pytest.raises(PmakitError, match="not a pmakit snapshot"):
        saver.save(state(3), tokens=20, step=2)
    assert list((tmp_path / "step-00000002").iterdir()) == []


def test_background_error_surfaces_at_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saver = SnapshotSaver(tmp_path, 10)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(saver_mod, "write_safetensors", disk_full)
    assert saver.maybe_save(state(0), tokens=10, step=1) is not None
    with pytest.raises(PmakitError, match="step-00000001 failed: OSError"):
        saver.maybe_save(state(0), tokens=20, step=2)  # a due save waits for the previous write
    assert list(tmp_path.iterdir()) == []  # no partial directory left behind, no visible snapshot
    monkeypatch.undo()
    saver.maybe_save(state(0), tokens=20, step=3)  # still due: the failed call saved nothing
    saver.wait()  # the error was reported once; the saver works again
    assert [s.tokens for s in discover(tmp_path)] == [20]


def test_a_signal_while_the_write_starts_leaves_a_saver_that_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's handler raises SystemExit wherever the main thread is: inside ``Thread.start`` of a save, the
    saver kept a thread never started, and the close on the way out raised "cannot join thread before it is
    started" (a traceback in a stopped model copy's output)."""
    saver = SnapshotSaver(tmp_path, 10)

    def stopped(self: object) -> None:
        raise SystemExit(143)

    monkeypatch.setattr(saver_mod.threading.Thread, "start", stopped)
    with pytest.raises(SystemExit):
        saver.maybe_save(state(0), tokens=10, step=1)
    saver.close()  # nothing to wait for, no error
    monkeypatch.undo()
    saver.maybe_save(state(0), tokens=20, step=2)
    saver.close()
    assert [s.tokens for s in discover(tmp_path)] == [20]


def test_crash_mid_write_leaves_only_a_hidden_incomplete_dir(tmp_path: Path) -> None:
    """A process killed after the weights but before pmakit.json: merge's discover() does not see the snapshot."""
    script = textwrap.dedent(
        f"""
        import os, torch
        import pmakit.saver as s
        saver = s.SnapshotSaver({str(tmp_path)!r}, 10)
        saver.save({{"w": torch.ones(3)}}, tokens=10, step=1)
        saver.wait()
        s.write_metadata = lambda *a, **k: os._exit(3)   # die between the weights and the metadata
        saver.save({{"w": torch.zeros(3)}}, tokens=20, step=2)
        saver.wait()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env={"PYTHONPATH": str(SRC)}, capture_output=True, timeout=1800
    )
    assert done.returncode == 3, done.stderr
    partial = tmp_path / ".step-00000002.pmakit-partial"
    assert (partial / "model.safetensors").exists() and not (partial / "pmakit.json").exists()
    assert [s.tokens for s in discover(tmp_path)] == [10]
    SnapshotSaver(tmp_path, 10, start_tokens=10, tidy=False)  # a non-writing copy: may be the writer's save
    assert (partial / "model.safetensors").exists()
    SnapshotSaver(tmp_path, 10, start_tokens=10)  # a resumed saver clears its own leftovers
    assert not partial.exists() and (tmp_path / "step-00000001" / "pmakit.json").exists()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(PmakitError, match="every_tokens"):
        SnapshotSaver(tmp_path, 0)
    with pytest.raises(PmakitError, match="keep_last"):
        SnapshotSaver(tmp_path, 10, keep_last=0)
    with pytest.raises(PmakitError, match="does not exist"):
        SnapshotSaver(tmp_path, 10, extra_files=[tmp_path / "nope.json"])


def test_copy_handles_scalars_empty_noncontiguous_and_integer_tensors(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": base.T,  # not contiguous
        "ids": torch.tensor([1, 2, 3], dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.float16),
    }
    copy, tied = cpu_copy(tensors)
    assert tied == {}
    for k, v in tensors.items():
        assert torch.equal(copy[k], v) and copy[k].dtype == v.dtype, k
        assert copy[k].data_ptr() != v.data_ptr() or v.numel() == 0
    snap = SnapshotSaver(tmp_path, 1, background=False).save(tensors, tokens=1, step=1)
    got = load(snap.path)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the pinned, asynchronous copy path)"
)
def test_snapshot_of_a_gpu_model_is_its_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = torch.nn.Linear(64, 32).cuda()
    saver = SnapshotSaver(tmp_path, every_tokens=10)
    before = model.weight.detach().cpu()
    saver.maybe_save(model, tokens=10, step=1)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on at once: the copy must already hold the old weights
    saver.wait()
    saved = load_file(tmp_path / "step-00000001" / "model.safetensors")
    assert torch.equal(saved["weight"], before)  # (w + 1) - 1 is not w in floating point


def test_writer_waits_for_the_device_copy_before_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's hand-off, exercised on the CPU: a copy still in flight (its CUDA event, here a stand-in)
    is waited for on the writer thread, before any byte is written, and then forgotten."""
    order: list[str] = []

    class Event:
        def synchronize(self) -> None:
            time.sleep(0.05)  # the copy lands late: the writer must not have started meanwhile
            order.append("on host")

    def copy(state: Any, dtype: torch.dtype | None = None) -> Any:
        out, tied = cpu_copy(state, dtype)
        saver_mod._READY[next(iter(out.values())).untyped_storage().data_ptr()] = Event()
        return out, tied

    def write(*args: Any, **kwargs: Any) -> None:
        order.append("written")
        real_write(*args, **kwargs)

    real_write = saver_mod.write_safetensors
    monkeypatch.setattr(saver_mod, "cpu_copy", copy)
    monkeypatch.setattr(saver_mod, "write_safetensors", write)
    saver = SnapshotSaver(tmp_path, 10)
    saver.maybe_save(state(0), tokens=10, step=1)
    saver.wait()
    assert order == ["on host", "written"] and not saver_mod._READY
    assert load(tmp_path / "step-00000001").keys() == state(0).keys()


def test_timings_split_the_training_threads_share_from_the_writers(tmp_path: Path) -> None:
    slow = 0.2
    saver = SnapshotSaver(tmp_path, 100, on_save=[lambda snap, st: time.sleep(slow)])
    model = state(0)
    assert saver.maybe_save(model, tokens=50, step=1) is None
    assert saver.timings == SaverTimings()  # a step with no save due costs no timed work
    for step in (1, 2, 3):  # back to back: each save waits for the previous write's sleeping callback
        saver.maybe_save(model, tokens=100 * step, step=step)
    saver.close()
    t = saver.timings
    assert t.saves == 3
    assert t.copy_seconds > 0 and t.writer_cpu_seconds > 0
    # The 2nd and 3rd saves waited for a sleeping callback (~2 x slow; a margin for a loaded machine).
    assert t.wait_seconds >= slow
    assert t.caller_seconds >= t.copy_seconds + t.wait_seconds
    # Thread CPU time, not wall time: the callbacks' sleeps are not the writer's work.
    assert t.callback_cpu_seconds < slow and t.callback_cpu_seconds <= t.writer_cpu_seconds


def test_averaging_hook_times_its_step_and_the_averagers_update(tmp_path: Path) -> None:
    hook = Averaging(tmp_path, 100, last=2)
    hook.start(None, 0)
    for step in range(1, 7):
        hook.step(state(step), tokens=50 * step, step=step)
    hook.close()
    t = hook.started_saver.timings
    assert t.saves == 3 and hook.averager.count == 2
    assert t.callback_cpu_seconds > 0  # the online averager's update ran on the writer thread
    assert hook.step_seconds >= t.caller_seconds > 0
