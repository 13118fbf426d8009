import gc
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import pmakit.merge as merge_mod
from conftest import load_dir, state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.merge import merge, partial_dir, plan_merge
from pmakit.merge.output import PROGRESS_DIR
from pmakit.snapshot import discover
from pmakit.weights import get_weights


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers whose difference counts ulps between floats of one dtype (sign-magnitude -> ordered)."""
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int64)
    sign = 1 << (8 * t.element_size() - 1)
    return torch.where(bits < 0, -(bits + sign), bits)


def assert_one_ulp(
    got: torch.Tensor, states: list[dict[str, torch.Tensor]], weights: list[float], name: str
) -> None:
    """got == the fp64 weighted sum cast once, within 1 ulp of the output dtype.

    Where the terms cancel, the exact sum can be far smaller than fp32 accumulation noise (2.8e-17 vs 1e-8); there
    the bound is the fp32 accumulation error N * eps32 * sum |w_i x_i| instead.
    """
    exact = reference(states, weights, name)
    want = exact.to(got.dtype)
    ulps = (ordered_bits(got) - ordered_bits(want)).abs()
    noise = len(states) * 2**-23 * sum(abs(w) * s[name].double().abs() for w, s in zip(weights, states))
    ok = (ulps <= 1) | ((got.double() - exact).abs() <= noise)
    assert bool(ok.all()), f"{name}: {int((~ok).sum())} elements off by more than 1 ulp"
    assert (ulps[exact.abs() > 1e-3] <= 1).all()


def reference(run_states: list[dict[str, torch.Tensor]], weights: list[float], name: str) -> torch.Tensor:
    return sum(w * s[name].to(torch.float64) for w, s in zip(weights, run_states))  # type: ignore[return-value]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["sma", "wma", "ema", "wsm-1sqrt"])
def test_merge_matches_fp64_reference_within_one_ulp(
    make_run: Callable[..., Path], tmp_path: Path, dtype: torch.dtype, method: str
) -> None:
    run = make_run(5, dtype=dtype)
    snaps = discover(run)
    weights = get_weights(method, len(snaps))
    merge(snaps, weights, tmp_path / "out", fsync=False)
    got = load_dir(tmp_path / "out")
    states = [state(i, dtype) for i in range(1, 6)]
    for name in states[0]:
        if name == "step_counter":
            continue
        assert got[name].dtype == dtype
        assert_one_ulp(got[name], states, weights, name)


def test_fp32_inputs_and_output_dtype(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(4, dtype=torch.float32)
    snaps = discover(run)
    w = get_weights("sma", 4)
    merge(snaps, w, tmp_path / "same", fsync=False)
    merge(snaps, w, tmp_path / "bf16", dtype="bf16", fsync=False)
    same, bf16 = load_dir(tmp_path / "same"), load_dir(tmp_path / "bf16")
    states = [state(i, torch.float32) for i in range(1, 5)]
    want = reference(states, w, "embed.weight")
    assert same["embed.weight"].dtype == torch.float32
    torch.testing.assert_close(same["embed.weight"].double(), want, rtol=4e-7, atol=4e-7)
    assert bf16["embed.weight"].dtype == torch.bfloat16
    for name in states[0]:  # the fp32 sums cast once: within one bf16 ulp of the exact average
        if name != "step_counter":
            assert_one_ulp(bf16[name], states, w, name)
    assert bf16["step_counter"].dtype == torch.int64  # --dtype never touches integers


def test_integer_tensors_copied_from_newest(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(3))
    merge(snaps, get_weights("sma", 3), tmp_path / "out", fsync=False)
    assert load_dir(tmp_path / "out")["step_counter"].tolist() == [3]


def test_large_tensor_is_streamed_in_chunks(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)  # embed.weight (1024 elements) -> 11 chunks
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", "1")  # one worker, three buffers: the tightest pipeline
    run = make_run(3)
    snaps = discover(run)
    plan = plan_merge(snaps, [1 / 3] * 3)
    assert plan.chunk_elems == 100
    merge(snaps, [0.2, 0.3, 0.5], tmp_path / "out", fsync=False)
    got = load_dir(tmp_path / "out")
    states = [state(i) for i in range(1, 4)]
    assert_one_ulp(got["embed.weight"], states, [0.2, 0.3, 0.5], "embed.weight")


def sparse_snapshot(path: Path, shapes: dict[str, tuple[int, ...]], tokens: int) -> None:
    """A valid bf16 safetensors snapshot of any size, zero-filled and sparse on disk (instant to make)."""
    from pmakit.formats.safetensors_io import OutputTensor, header_bytes
    from pmakit.snapshot import write_metadata

    path.mkdir(parents=True)
    tensors = [OutputTensor(k, torch.bfloat16, s) for k, s in shapes.items()]
    head = header_bytes(tensors)
    with open(path / "model.safetensors", "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(t.nbytes for t in tensors))
    write_metadata(path, step=tokens, tokens=tokens)


def test_planned_work_memory_is_independent_of_n_and_model_size(tmp_path: Path) -> None:
    """The plan's work memory (output buffers + the fold workers' scratch) is the same for 2 or 16 inputs of 64 MiB
    or 2 GiB. The memory a merge really takes is measured by ``make bench`` (anonymous memory: 215-217 MiB at N = 8
    and 16, docs/benchmarks.md), not here."""
    small = {"w": (4096, 4096)}
    big = {f"layer{i}.w": (4096, 4096) for i in range(64)} | {
        "embed": (128_256, 8192)
    }  # ~2 GiB, 1 GiB tensor
    plans = []
    for name, shapes, n in (("a", small, 2), ("b", small, 16), ("c", big, 2), ("d", big, 16)):
        for i in range(n):
            sparse_snapshot(tmp_path / name / f"s{i}", shapes, tokens=i)
        plans.append(plan_merge(discover(tmp_path / name), [1 / n] * n))
    assert len({p.peak_memory for p in plans}) == 1
    # a 32 MiB output buffer and 2 MiB of scratch a fold worker (as many as this machine gives), two for the writer
    assert plans[-1].peak_memory <= (plans[-1].fold.workers + 2) * 34 * 2**20
    # and the merge runs on that plan: an all-zero 16-way merge of the 16M-element tensor
    merge(plans[1].snapshots, plans[1].weights, tmp_path / "out", fsync=False)
    assert load_dir(tmp_path / "out")["w"].abs().sum() == 0


def test_sharded_output_with_index(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(2))
    merge(snaps, [0.5, 0.5], tmp_path / "out", max_shard_size=2500, fsync=False)
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0].name.endswith(f"-of-{len(shards):05d}.safetensors")
    assert set(index["weight_map"]) == set(state(1))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state(1).values())
    # embed.weight is 2048 bytes in bf16; nothing but a too-large tensor exceeds the limit
    for f in shards:
        with safe_open(f, framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
            sizes = [h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys()]  # noqa: SIM118
            assert sum(sizes) <= 2500 or len(sizes) == 1


def test_sharded_input_symlinks_and_index_without_total_size(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    snaps = discover(make_run(2))
    merge(snaps, [0.5, 0.5], tmp_path / "sharded", max_shard_size=2500, fsync=False)
    # Build an HF-cache-like snapshot: shard files are symlinks to blobs elsewhere, index without metadata.
    cache = tmp_path / "cache"
    blobs = cache / "blobs"
    snap = cache / "snap"
    blobs.mkdir(parents=True)
    snap.mkdir()
    for f in (tmp_path / "sharded").glob("model-*.safetensors"):
        os.replace(f, blobs / f.name)
        (snap / f.name).symlink_to(blobs / f.name)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    del index["metadata"]
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    (snap / "pmakit.json").write_text('{"step": 1, "tokens": 5}')
    from pmakit.snapshot import read_snapshot

    merge([read_snapshot(snap)], [1.0], tmp_path / "again", fsync=False)
    assert load_dir(tmp_path / "again").keys() == state(1).keys()


def test_index_path_escaping_the_snapshot_is_refused(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(2))
    bad = snaps[1].path
    os.replace(bad / "model.safetensors", tmp_path / "outside.safetensors")
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "../../outside.safetensors" for k in state(1)}})
    )
    with pytest.raises(PmakitError, match="outside the snapshot directory"):
        merge(snaps, [0.5, 0.5], tmp_path / "out", fsync=False)


@pytest.mark.parametrize("fmt", ["pt", "nested-pt"])
def test_torch_inputs(make_run: Callable[..., Path], tmp_path: Path, fmt: str) -> None:
    snaps = discover(make_run(3, fmt=fmt))
    plan = plan_merge(snaps, [1 / 3] * 3)
    if fmt == "nested-pt":
        assert "ckpt.pt:optimizer" in plan.skipped and "ckpt.pt:iter_num" in plan.skipped
    merge(snaps, [1 / 3] * 3, tmp_path / "out", fsync=False)
    got = load_dir(tmp_path / "out")["head.weight"]
    assert_one_ulp(got, [state(i) for i in range(1, 4)], [1 / 3] * 3, "head.weight")


def test_pickle_with_code_is_refused(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2, fmt="pt")
    victim = discover(run)[0].path / "model.pt"
    torch.save({"w": torch.zeros(2), "obj": Path("x")}, victim)  # a non-tensor object: not weights_only-safe
    with pytest.raises(PmakitError, match="weights_only"):
        merge(discover(run), [0.5, 0.5], tmp_path / "out")


def test_config_and_tokenizer_copied_from_newest_and_manifest(tmp_path: Path) -> None:
    for i in (1, 2):
        write_snapshot(
            tmp_path / "run" / f"s{i}",
            state(i),
            step=i,
            tokens=i * 10,
            extra_files={"config.json": f'{{"v": {i}}}', "tokenizer.json": "{}"},
        )
    (tmp_path / "run" / "s2" / "optimizer.pt").write_bytes(b"not copied")
    snaps = discover(tmp_path / "run")
    res = merge(snaps, [0.25, 0.75], tmp_path / "out", manifest_extra={"method": "custom"}, fsync=False)
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text()) == {"v": 2}
    assert (out / "tokenizer.json").exists() and not (out / "optimizer.pt").exists()
    assert not (out / "pmakit.json").exists()  # a merged model is not a training snapshot
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert manifest == res.manifest
    assert manifest["weights"] == [0.25, 0.75] and manifest["method"] == "custom"
    assert [i["tokens"] for i in manifest["inputs"]] == [10, 20]
    assert len(manifest["inputs"][0]["files"][0]["header_sha256"]) == 64
    assert manifest["version"] and manifest["dtype"] == "same"


def test_mismatched_inputs_list_every_difference(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(3)
    odd = state(9)
    odd["embed.weight"] = torch.zeros(65, 16, dtype=torch.bfloat16)
    odd["layers.0.norm.weight"] = torch.zeros(16, dtype=torch.float32)
    del odd["head.weight"]
    odd["extra.bias"] = torch.zeros(3, dtype=torch.bfloat16)
    write_snapshot(run / "step-000100", odd, step=100, tokens=1000)
    with pytest.raises(PmakitError) as e:
        merge(discover(run), [1 / 3] * 3, tmp_path / "out")
    msg = str(e.value)
    # layers.0.norm.weight differs only in float precision (fp32 here, bf16 in the others): not a difference.
    for part in ("3 differences", "lacks 1 tensors", "head.weight", "extra.bias", "[65, 16]"):
        assert part in msg, part
    assert "layers.0.norm.weight" not in msg
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()


def test_snapshots_differing_only_in_float_precision_merge_in_the_widest(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """A run's checkpoints in fp32 and its last save exported in fp16 (torchtitan's export_dtype): one run, summed in
    fp32 and written in fp32; the manifest says which input was in which dtype and why."""
    run = tmp_path / "run"
    states = [{k: v.float() for k, v in state(i).items()} for i in (1, 2)]
    states.append({k: v.half() for k, v in state(3).items()})
    for i, s in enumerate(states, 1):
        write_snapshot(run / f"step-{i:06d}", s, step=i, tokens=10 * i)
    res = merge(discover(run), [1 / 3] * 3, tmp_path / "out")
    got = load_file(tmp_path / "out" / "model.safetensors")
    for name in states[0]:
        want = torch.stack([s[name].float() for s in states]).mean(0)
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want, msg=name)
    precision = res.manifest["precision"]
    assert list(precision["inputs"].values()) == ["float32", "float32", "float16"]
    assert precision["output"] == "float32" and "widest" in precision["why"]
    # fp16 and bf16 inputs: neither holds the other's values, so fp32; --dtype still chooses.
    write_snapshot(run / "step-000001", {k: v.bfloat16() for k, v in state(1).items()}, step=1, tokens=10)
    write_snapshot(run / "step-000002", {k: v.half() for k, v in state(2).items()}, step=2, tokens=20)
    merge(discover(run), [1 / 3] * 3, tmp_path / "out2")
    assert {t.dtype for t in load_file(tmp_path / "out2" / "model.safetensors").values()} == {torch.float32}
    merge(discover(run), [1 / 3] * 3, tmp_path / "out3", dtype="bf16")
    assert {t.dtype for t in load_file(tmp_path / "out3" / "model.safetensors").values()} == {torch.bfloat16}


def test_nan_names_tensor_and_snapshot_and_leaves_nothing(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(3)
    bad = state(2)
    bad["layers.1.attn.weight"][3, 4] = float("nan")
    write_snapshot(run / "step-000200", bad, step=200, tokens=2000)
    with pytest.raises(PmakitError, match=r"'layers.1.attn.weight' of .*step-000200.*--exclude"):
        merge(discover(run), [1 / 3] * 3, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()


def test_inf_in_an_input_is_caught(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2, dtype=torch.float32)
    bad = state(1, torch.float32)
    bad["head.weight"][0, 0] = float("inf")
    write_snapshot(run / "step-000100", bad, step=100, tokens=1000)
    with pytest.raises(PmakitError, match="'head.weight' of .*step-000100"):
        merge(discover(run), [0.5, 0.5], tmp_path / "out")


def test_truncated_file_is_a_clear_error(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2)
    f = discover(run)[1].path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(PmakitError, match="truncated or corrupt"):
        merge(discover(run), [0.5, 0.5], tmp_path / "out")
    f.write_bytes(b"\x01")
    with pytest.raises(PmakitError, match="corrupt safetensors"):
        merge(discover(run), [0.5, 0.5], tmp_path / "out")


def test_existing_output_needs_force_and_force_replaces_only_when_done(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    snaps = discover(make_run(2))
    out = tmp_path / "out"
    merge(snaps, [0.5, 0.5], out, fsync=False)
    with pytest.raises(PmakitError, match="exists; pass --force"):
        merge(snaps, [0.5, 0.5], out)
    (out / "marker").write_text("old")
    bad = state(2)
    bad["head.weight"][0, 0] = float("nan")
    write_snapshot(snaps[1].path, bad, step=200, tokens=2000)
    with pytest.raises(PmakitError):
        merge(snaps, [0.5, 0.5], out, force=True)
    assert (out / "marker").exists()  # a failed --force merge keeps the old output
    write_snapshot(snaps[1].path, state(2), step=200, tokens=2000)
    merge(snaps, [0.5, 0.5], out, force=True, fsync=False)
    assert not (out / "marker").exists() and (out / "pmakit-merge.json").exists()


def test_interrupt_leaves_no_output_and_keeps_its_work(
    make_run: Callable[..., Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snaps = discover(make_run(3))
    calls = 0

    def progress(_: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt

    out, shards = tmp_path / "out", {"max_shard_size": 2500}  # 3 output shards
    with pytest.raises(KeyboardInterrupt):
        merge(snaps, [1 / 3] * 3, out, progress=progress, **shards)
    # Nothing that looks finished; the hidden partial output stays for the same call to continue.
    assert not out.exists() and partial_dir(out).is_dir()
    kept = {
        p.name.removesuffix(".json"): os.stat(partial_dir(out) / p.name.removesuffix(".json"))
        for p in (partial_dir(out) / PROGRESS_DIR).glob("*.safetensors.json")
    }
    assert kept, "the interruption came before the first shard was finished"
    monkeypatch.setattr(logging.getLogger("pmakit"), "propagate", True)  # (off where the CLI ran in-process)
    with caplog.at_level(logging.WARNING, logger="pmakit"):
        merge(snaps, [1 / 3] * 3, out, **shards)
    assert "continuing the interrupted merge" in caplog.text
    for name, before in kept.items():  # the finished shards kept, not written again
        after = os.stat(out / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name
    merge(snaps, [1 / 3] * 3, tmp_path / "ref", **shards)
    assert not partial_dir(out).exists()
    files = sorted(f.name for f in (tmp_path / "ref").glob("*.safetensors"))
    assert len(files) > len(kept) and sorted(f.name for f in out.glob("*.safetensors")) == files
    for name in files:
        assert (tmp_path / "ref" / name).read_bytes() == (out / name).read_bytes()


def test_disk_full_is_one_error_and_cleans_up(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = discover(make_run(2))
    from pmakit.formats import safetensors_io

    real = safetensors_io.ShardWriter.write

    def full(self: object, name: str, chunk: torch.Tensor) -> None:
        if name == "layers.1.attn.weight":
            raise OSError(28, "No space left on device")
        real(self, name, chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors_io.ShardWriter, "write", full)
    with pytest.raises(PmakitError, match="disk full"):
        merge(snaps, [0.5, 0.5], tmp_path / "out")
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()


def test_not_enough_space_is_refused_before_writing(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil
    from collections import namedtuple

    snaps = discover(make_run(2))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9, 10))
    with pytest.raises(PmakitError, match="not enough disk space"):
        merge(snaps, [0.5, 0.5], tmp_path / "out")
    assert not partial_dir(tmp_path / "out").exists()


def test_inputs_without_model_weights_are_one_error(tmp_path: Path) -> None:
    """A torch file of trainer state only (no tensor): one error, not a crash in planning or writing."""
    from click.testing import CliRunner

    from pmakit.cli import cli

    for step in (1, 2):
        (tmp_path / "run" / f"step-{step}").mkdir(parents=True)
        torch.save({"iteration": step, "lr": 0.1}, tmp_path / "run" / f"step-{step}" / "state.pt")
    snaps = discover(tmp_path / "run", tokens_per_step=10)
    with pytest.raises(PmakitError, match="no model weights"):
        plan_merge(snaps, [0.5, 0.5])
    run, out = str(tmp_path / "run"), str(tmp_path / "out")
    for args in (["inspect", run], ["merge", run, "-o", out]):
        r = CliRunner().invoke(cli, [*args, "--tokens-per-step", "10"])
        assert r.exit_code == 1 and "no model weights" in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_average_states_reads_a_generator_one_state_at_a_time() -> None:
    """`recover` averages snapshots read one by one: no earlier state may still be alive when the next is read."""
    refs: list[weakref.ref[torch.Tensor]] = []
    alive_when_read: list[int] = []

    def states() -> Iterator[dict[str, torch.Tensor]]:
        for i in range(1, 6):
            gc.collect()
            alive_when_read.append(sum(r() is not None for r in refs))
            s = state(i)
            refs.append(weakref.ref(s["embed.weight"]))
            yield s
            del s

    got = merge_mod.average_states(states(), [0.2] * 5, dtype="same")
    assert alive_when_read == [0, 0, 0, 0, 0]
    want = merge_mod.average_states([state(i) for i in range(1, 6)], [0.2] * 5)
    assert got.keys() == want.keys() and got["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(got["embed.weight"], want["embed.weight"].to(torch.bfloat16))
    assert torch.equal(got["step_counter"], state(5)["step_counter"])
    with pytest.raises(ValueError, match="fewer states"):
        merge_mod.average_states([state(1)], [0.5, 0.5])


def test_a_partial_output_killed_before_its_plan_is_started_again(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """SIGKILL between making the partial directory and recording the plan in it (seen in the suite's random-kill
    test) left a partial the same command refused ("no readable progress record ... pass --force"): with nothing
    written there is nothing to keep, so the merge starts again. A partial holding files but no plan still needs
    --force: its files cannot be checked."""
    snaps = discover(make_run(3))
    out, ref = tmp_path / "out", tmp_path / "ref"
    merge(snaps, [1 / 3] * 3, ref, fsync=False)
    (partial_dir(out) / PROGRESS_DIR).mkdir(
        parents=True
    )  # as a kill right after Ledger.start's mkdir leaves it
    merge(snaps, [1 / 3] * 3, out, fsync=False)
    assert not partial_dir(out).exists()
    for f in ref.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes()
    other = tmp_path / "other"
    partial_dir(other).mkdir()
    (partial_dir(other) / "model.safetensors").write_bytes(b"half")
    with pytest.raises(
        PmakitError, match="no readable progress record, so it cannot be resumed; pass --force"
    ):
        merge(snaps, [1 / 3] * 3, other, fsync=False)
    assert (partial_dir(other) / "model.safetensors").read_bytes() == b"half"
