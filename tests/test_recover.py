"""Spike detection on synthetic loss series, the rollback choice at its edges, and `pmakit recover` end to end."""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import SHAPES, load_dir, run_cli, state, write_snapshot, write_states
from pmakit.errors import PmakitError
from pmakit.merge import merge
from pmakit.recover import (
    Spike,
    SpikeConfig,
    SpikeDetector,
    choose_rollback,
    find_spikes,
    loss_lag_tokens,
    merged_state,
    recover,
    robust_z,
    spike_boundary,
)
from pmakit.snapshot import Snapshot, discover, read_snapshot, write_metadata
from pmakit.train.spike_recovery import RecoveryConfig, SpikeRecovery

TPS = 100  # tokens per step in the synthetic series


def series(
    n: int, *, seed: int = 0, level: float = 3.0, noise: float = 0.02, slope: float = 0.0
) -> list[float]:
    """A noisy training loss: level + slope*step + gaussian noise (deterministic in seed)."""
    rng = random.Random(seed)
    return [level + slope * i + rng.gauss(0.0, noise) for i in range(n)]


def feed(
    losses: list[float], config: SpikeConfig | None = None, grads: list[float] | None = None
) -> list[Spike]:
    records = [
        {
            "kind": "train",
            "step": i,
            "tokens": i * TPS,
            "loss": x,
            "grad_norm": None if grads is None else grads[i],
        }
        for i, x in enumerate(losses)
    ]
    return find_spikes(records, config)


# ------------------------------------------------------------------------------------------------ the detector


def test_clean_series_has_no_spike() -> None:
    for seed in range(5):
        falling = [x - 0.002 * i for i, x in enumerate(series(400, seed=seed))]
        assert feed(falling) == []


def test_one_spike_start_is_the_first_out_of_line_step_not_the_detection() -> None:
    losses = series(300)
    for i in range(150, 170):  # the loss jumps at step 150 and stays up
        losses[i] += 2.0
    spikes = feed(losses, SpikeConfig(patience=3))
    assert len(spikes) == 1
    s = spikes[0]
    assert (s.start_step, s.start_tokens) == (150, 150 * TPS)
    assert (s.detected_step, s.detected_tokens) == (152, 152 * TPS)  # patience 3: steps 150, 151, 152
    assert s.reason == "loss" and s.steps == 3
    assert s.baseline == pytest.approx(3.0, abs=0.02)
    assert s.z is not None and s.z > 50


def test_spike_start_widens_over_a_rising_onset() -> None:
    losses = series(300, noise=0.02)
    losses[148] = 3.0 + 0.09  # about z=4.5: above onset 3, below threshold 6
    losses[149] = 3.0 + 0.10
    for i in range(150, 160):
        losses[i] += 1.0
    assert feed(losses)[0].start_step == 148
    assert feed(losses, SpikeConfig(onset=None))[0].start_step == 150


def test_slow_drift_is_not_a_spike() -> None:
    # Rising 0.01/step (the loss climbs 4 nats over the series) is a drift, not a spike, whatever the noise.
    for noise in (0.0, 0.02):
        assert feed(series(400, slope=0.01, noise=noise)) == []
    # Why: the next point of a pure ramp has robust z = ((w+1)/2) / (1.4826 * w/4), about 1.4, for any slope.
    for slope in (0.5, 1e-4):
        ramp = [slope * i for i in range(50)]
        assert robust_z(slope * 50, ramp, 0.0) == pytest.approx(25.5 / (1.4826 * 12.5), rel=1e-9)


def test_nan_and_inf_are_spikes_at_once_even_before_any_history() -> None:
    for bad in (math.nan, math.inf):
        losses = series(100)
        losses[3] = bad
        (s,) = feed(losses)
        assert (s.start_step, s.detected_step, s.reason, s.steps) == (3, 3, "non-finite loss", 1)
        json.dumps(s.to_dict(), allow_nan=False)  # JSON-safe record


def test_nan_after_a_rising_excursion_starts_where_the_excursion_did() -> None:
    losses = series(100)
    losses[60] += 1.0
    losses[61] += 2.0
    losses[62] = math.nan
    (s,) = feed(losses, SpikeConfig(patience=5))
    assert (s.start_step, s.detected_step, s.reason) == (60, 62, "non-finite loss")


def test_spike_during_warmup_is_ignored() -> None:
    losses = series(300)
    for i in range(10, 14):
        losses[i] += 3.0
    config = SpikeConfig(warmup_tokens=100 * TPS, min_history=5)
    assert feed(losses, config) == []
    # The same jump after warmup is caught.
    losses2 = series(300)
    for i in range(120, 124):
        losses2[i] += 3.0
    assert [s.start_step for s in feed(losses2, config)] == [120]


def test_a_blip_shorter_than_patience_is_not_a_spike() -> None:
    losses = series(300)
    losses[100] += 2.0
    losses[101] += 2.0
    assert feed(losses, SpikeConfig(patience=3)) == []
    assert [s.start_step for s in feed(losses, SpikeConfig(patience=2))] == [100]


def test_one_report_per_excursion_and_a_second_spike_after_recovery() -> None:
    losses = series(400)
    for i in range(100, 150):
        losses[i] += 2.0  # 50 steps up: one spike, not 16
    for i in range(300, 305):
        losses[i] += 2.0  # back in line, then a second, separate spike
    assert [s.start_step for s in feed(losses)] == [100, 300]


def test_grad_norm_is_watched_only_when_asked() -> None:
    losses = series(300)
    grads = [1.0 + 0.05 * x for x in series(300, seed=7, level=0.0, noise=1.0)]
    for i in range(200, 210):
        grads[i] = 20.0
    assert feed(losses, SpikeConfig(), grads) == []
    (s,) = feed(losses, SpikeConfig(grad_threshold=6.0), grads)
    assert (s.start_step, s.reason) == (200, "grad norm")
    grads[250] = math.inf  # non-finite grad norm: out of line at once (counts towards patience)
    spikes = feed(losses, SpikeConfig(grad_threshold=6.0, patience=1), grads)
    assert [s.start_step for s in spikes] == [200, 250]


def test_detector_rewinds_when_tokens_go_back() -> None:
    losses = series(300)
    for i in range(150, 160):
        losses[i] += 2.0
    d = SpikeDetector()
    for i in range(155):
        d.update(i * TPS, losses[i], step=i)
    assert d.in_spike
    # The run was rolled back to 140 and continues in line: no second report, and the spike is forgotten.
    assert all(d.update(i * TPS, 3.0 + 0.01 * (i % 3), step=i) is None for i in range(140, 200))
    assert not d.in_spike and d.baseline == pytest.approx(3.0, abs=0.02)


def test_detector_is_deterministic() -> None:
    losses = series(500, seed=3)
    for i in range(250, 260):
        losses[i] *= 2
    found = feed(losses)
    assert found and found == feed(losses)  # the spike at 250 is found, and again the same


def test_bad_config_is_a_user_error() -> None:
    for bad in ({"window": 2}, {"patience": 0}, {"min_history": 100}, {"threshold": -1}, {"onset": 9.0}):
        ((field, value),) = bad.items()
        # the error names the setting at fault and its value (not another check that happens to fail too)
        with pytest.raises(PmakitError, match=rf"^spike {field} must be .*, got {re.escape(str(value))}$"):
            SpikeConfig(**bad)


# ------------------------------------------------------------------------------------------------ the rollback


def snaps(*tokens: int) -> list[Snapshot]:
    return [Snapshot(Path(f"/nonexistent/step-{t}"), tokens=t, step=t // 10) for t in tokens]


@pytest.mark.parametrize(
    ("start", "k", "expected"),
    [
        (700, 3, [400, 500, 600]),  # a snapshot exactly at the start is excluded
        (701, 3, [500, 600, 700]),  # one token later it is in
        (10_000, 3, [800, 900, 1000]),  # spike after the newest snapshot
        (300, 2, [100, 200]),  # exactly k available
        (700, 1, [600]),  # k=1: the latest pre-spike snapshot (the control)
    ],
)
def test_rollback_takes_exactly_the_last_k_strictly_before(start: int, k: int, expected: list[int]) -> None:
    chosen = choose_rollback(snaps(*range(1000, 0, -100)), start, k)  # given newest first: sorted
    assert [s.tokens for s in chosen] == expected


def test_rollback_with_fewer_than_k_is_an_error_unless_allowed() -> None:
    with pytest.raises(PmakitError, match=r"--last 3 asks for 3 snapshots before 250 tokens but only 2"):
        choose_rollback(snaps(100, 200, 300), 250, 3)
    assert [s.tokens for s in choose_rollback(snaps(100, 200, 300), 250, 3, allow_fewer=True)] == [100, 200]
    for allow in (False, True):  # nothing before the start: always an error
        with pytest.raises(PmakitError, match="no complete snapshot before 100 tokens"):
            choose_rollback(snaps(100, 200), 100, 3, allow_fewer=allow)
    with pytest.raises(PmakitError, match="at least 1"):
        choose_rollback(snaps(100), 500, 0)


# ---------------------------------------------------------------------------------------------- pmakit recover


def build_run(root: Path, n: int = 8, every: int = 1000, spike_at: int | None = None) -> Path:
    """RUN/snapshots/step-*/ every `every` tokens and RUN/metrics.jsonl, one step = TPS tokens, spiking at spike_at."""
    run = root / "run"
    for i in range(1, n + 1):
        tokens = i * every
        write_snapshot(
            run / "snapshots" / f"step-{tokens // TPS:08d}", state(i), step=tokens // TPS, tokens=tokens
        )
    losses = series(n * every // TPS + 1, seed=1)
    if spike_at is not None:
        for i in range(spike_at // TPS, len(losses)):
            losses[i] += 3.0
    with open(run / "metrics.jsonl", "w") as f:
        for i, x in enumerate(losses):
            f.write(json.dumps({"kind": "train", "step": i, "tokens": i * TPS, "loss": x}) + "\n")
            if i % 10 == 0:
                f.write(
                    json.dumps({"kind": "eval", "tokens": i * TPS, "model": "latest", "val_loss": 9.9}) + "\n"
                )
    return run


def assert_one_line_error(proc: object, *fragments: str) -> None:
    assert proc.returncode == 1  # type: ignore[attr-defined]
    err = proc.stderr.strip()  # type: ignore[attr-defined]
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("Error: "), err
    for f in fragments:
        assert f in err, (f, err)


def test_recover_before_equals_pmakit_merge_of_the_last_k(tmp_path: Path) -> None:
    run = build_run(tmp_path)
    proc = run_cli("recover", run, "--before", "7K", "--last", "3", "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "resume with: pmakit train --resume-from" in proc.stdout
    ref = run_cli("merge", run, "--last", "3", "--until", "6999", "-o", tmp_path / "ref", "--quiet")
    assert ref.returncode == 0, ref.stderr
    got, want = load_dir(tmp_path / "out"), load_dir(tmp_path / "ref")
    assert got.keys() == want.keys() == state(1).keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # and against the simple reference: the bf16 cast of the fp64 mean of snapshots 4, 5, 6 (7000 is excluded)
    mean = torch.stack([state(i)["layers.0.attn.weight"].double() for i in (4, 5, 6)]).mean(0)
    assert torch.allclose(got["layers.0.attn.weight"].double(), mean, atol=1e-2, rtol=1e-2)

    snap = read_snapshot(tmp_path / "out")  # a complete snapshot, at the newest merged one's step/tokens
    assert (snap.tokens, snap.step) == (6000, 60)
    rec = snap.meta["recovery"]
    assert [m["tokens"] for m in rec["merged"]] == [4000, 5000, 6000]
    assert rec["weights"] == pytest.approx([1 / 3] * 3)
    assert (rec["before_tokens"], rec["why"], rec["spike"], rec["optimizer"]) == (
        7000,
        "--before given",
        None,
        "reset",
    )
    assert (tmp_path / "out" / "config.json").exists()
    assert not list(tmp_path.glob(".out*"))  # no staging left behind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("method", ["sma", "ema"])
def test_merged_state_in_memory_is_the_written_merge_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype, method: str
) -> None:
    """What the rollback loads (averaged in memory) is byte for byte what `pmakit merge` writes, dtypes included."""
    shapes = {**SHAPES, "big.weight": (300_007,)}  # several of the engine's blocks, and an odd tail
    states = [state(i, dtype, shapes) for i in range(1, 5)]
    snaps = discover(write_states(tmp_path / "run", states, every=1, tokens_per_step=1000, digits=8))
    got, weights = merged_state(snaps, method, 0.3)
    merge(snaps, weights, tmp_path / "ref", fsync=False)
    want = load_dir(tmp_path / "ref")
    assert got.keys() == want.keys() == state(1, dtype, shapes).keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k].flatten().view(torch.uint8), want[k].flatten().view(torch.uint8)), k
    assert torch.equal(got["step_counter"], state(4)["step_counter"])  # non-float: the newest snapshot's


def test_merged_state_refuses_a_snapshot_with_nan(tmp_path: Path) -> None:
    bad = state(2)
    bad["layers.0.attn.weight"][0, 0] = float("nan")
    write_states(tmp_path, [state(1), bad, state(3)], every=1, tokens_per_step=1000, digits=8)
    with pytest.raises(PmakitError, match=r"'layers.0.attn.weight' of .*step-00000002"):
        merged_state(discover(tmp_path), "sma", 0.2)


def test_recover_finds_the_spike_in_the_metrics_log(tmp_path: Path) -> None:
    run = build_run(tmp_path, spike_at=6500)
    out = tmp_path / "out"
    result = recover(run, out=out, last=2, method="wma")
    assert result.spike is not None and result.spike.start_tokens == 6500
    assert result.before_tokens == 6400  # the loss logged at 6500 was measured on the weights at 6400
    assert [s.tokens for s in result.snapshots] == [5000, 6000]
    meta = json.loads((out / "pmakit.json").read_text())
    assert meta["tokens"] == 6000
    assert meta["recovery"]["spike"]["start_tokens"] == 6500
    assert meta["recovery"]["loss_lag_tokens"] == TPS
    assert "a loss spike in metrics.jsonl" in meta["recovery"]["why"]
    assert meta["recovery"]["weights"] == pytest.approx([1 / 3, 2 / 3])
    got = load_dir(out)["head.weight"].double()
    want = (state(5)["head.weight"].double() + 2 * state(6)["head.weight"].double()) / 3
    assert torch.allclose(got, want, atol=2e-2)


def test_recover_excludes_the_snapshot_whose_weights_made_the_first_bad_loss(tmp_path: Path) -> None:
    # The first bad loss is logged at 6100 tokens: it came from the weights after step 60, i.e. at 6000 tokens.
    run = build_run(tmp_path, spike_at=6100)
    result = recover(run, out=tmp_path / "out", last=2)
    assert (result.before_tokens, [s.tokens for s in result.snapshots]) == (6000, [4000, 5000])
    # one step later the 6000 snapshot is clean again
    run2 = build_run(tmp_path / "b", spike_at=6200)
    assert [s.tokens for s in recover(run2, out=tmp_path / "out2", last=2).snapshots] == [5000, 6000]


def test_boundary_with_sparse_logs_is_the_last_in_line_record() -> None:
    # Logged every 10 steps of 10 tokens: the loss at step 1000 is the first bad one; steps 991-999 were not
    # logged, so the weights after step 990 (9900 tokens) on are suspect.
    losses = series(200)
    records: list[dict[str, Any]] = [
        {"kind": "train", "step": 10 * i, "tokens": 100 * i, "loss": x} for i, x in enumerate(losses)
    ]
    for r in records[100:]:
        r["loss"] += 2.0
    (spike,) = find_spikes(records)
    assert (spike.start_step, spike.previous_tokens) == (1000, 9900)
    assert loss_lag_tokens(records) == 10
    assert spike_boundary(spike, 10) == 9900  # not 10000 - 10
    # one record per step: the previous record is one step back, the same as the lag
    per_step: list[dict[str, Any]] = [
        {"kind": "train", "step": i, "tokens": 10 * i, "loss": x} for i, x in enumerate(losses)
    ]
    for r in per_step[100:]:
        r["loss"] += 2.0
    (spike,) = find_spikes(per_step)
    assert spike_boundary(spike, loss_lag_tokens(per_step)) == spike.previous_tokens == 990


def test_loss_lag_from_steps_or_from_the_smallest_gap() -> None:
    with_steps = [{"tokens": 2560 * s, "step": s} for s in (10, 20, 30)]  # logged every 10 steps
    assert loss_lag_tokens(with_steps) == 2560
    assert loss_lag_tokens([{"tokens": t} for t in (100, 300, 400, 400)]) == 100
    assert loss_lag_tokens([{"tokens": 5}]) == 0


def test_recover_keep_latest_copies_the_pre_spike_optimizer_state(tmp_path: Path) -> None:
    run = build_run(tmp_path, spike_at=6500)
    ckpt = run / "checkpoint"
    write_snapshot(ckpt, state(9), step=750, tokens=7500)  # the trainer's latest checkpoint: past the spike
    torch.save({"state": {}, "tag": "late"}, ckpt / "optimizer.pt")
    with pytest.raises(PmakitError, match="no full checkpoint with optimizer state before 6.4K"):
        recover(run, out=tmp_path / "out", optimizer="keep-latest")
    # A snapshot directory that also holds optimizer state, before the spike, is used.
    torch.save({"state": {}, "tag": "early"}, run / "snapshots" / "step-00000050" / "optimizer.pt")
    result = recover(run, out=tmp_path / "out", optimizer="keep-latest")
    assert result.optimizer_from is not None and result.optimizer_from.tokens == 5000
    assert torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True)["tag"] == "early"
    assert result.record["optimizer_from"]["tokens"] == 5000
    # A full state the trainer kept at a fork point (RUN/checkpoints/tokens-T) and newer still wins.
    kept = write_snapshot(run / "checkpoints" / "tokens-6300", state(9), step=63, tokens=6300)
    torch.save({"state": {}, "tag": "kept"}, kept / "optimizer.pt")
    result = recover(run, out=tmp_path / "out", optimizer="keep-latest", force=True)
    assert result.optimizer_from is not None and result.optimizer_from.tokens == 6300
    assert torch.load(tmp_path / "out" / "optimizer.pt", weights_only=True)["tag"] == "kept"
    # reset never copies optimizer state
    recover(run, out=tmp_path / "out2")
    assert not (tmp_path / "out2" / "optimizer.pt").exists()


def test_recover_errors_are_one_line_through_the_cli(tmp_path: Path) -> None:
    run = build_run(tmp_path)  # no spike in its log
    out = tmp_path / "out"
    assert_one_line_error(run_cli("recover", run, "-o", out), "no loss spike found", "--before")
    assert_one_line_error(
        run_cli("recover", run, "--before", "2500", "-o", out), "--last 3 asks for 3", "only 2 exist"
    )
    assert_one_line_error(run_cli("recover", run, "--before", "5K", "--last", "0", "-o", out), "at least 1")


def test_recover_refuses_user_mistakes(tmp_path: Path, make_run: Callable[..., Path]) -> None:
    run = build_run(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(PmakitError, match="no complete snapshot before 1K tokens"):
        recover(run, out=out, before=1000)
    with pytest.raises(PmakitError, match=r"no full checkpoint with optimizer state.*use --optimizer reset"):
        recover(run, out=out, before=5000, optimizer="keep-latest")
    with pytest.raises(PmakitError, match="no such run directory"):
        recover(tmp_path / "nope", out=out, before=5000)
    flat = make_run(5, name="flat")  # snapshots directly in RUN, no metrics.jsonl
    with pytest.raises(PmakitError, match="metrics.jsonl not found: pass --before"):
        recover(flat, out=out)
    with pytest.raises(PmakitError, match="inside the run's snapshot folder"):
        recover(flat, out=flat / "rolled-back", before=3000)
    recover(flat, out=out, before=3000, last=2)
    with pytest.raises(PmakitError, match="exists; pass --force"):
        recover(flat, out=out, before=3000)
    recover(flat, out=out, before=4000, last=2, force=True)
    assert read_snapshot(out).tokens == 3000
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging or old copy left


def test_recovered_tiny_llama_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    run = tmp_path / "run"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for i in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        d = run / "snapshots" / f"step-{i * 10:08d}"
        model.save_pretrained(d)
        write_metadata(d, step=i * 10, tokens=i * 1000)
    recover(run, out=tmp_path / "out", before=3500, last=3)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(loaded(ids).logits).all()


# ------------------------------------------------------------------------------------- SpikeRecovery in training

TRAIN_TPS = 8 * 32  # batch 8 x seq_len 32
EVERY = 8 * TRAIN_TPS  # a snapshot every 8 steps


def tiny_corpus(vocab: int = 64, n: int = 40_000, seed: int = 0) -> Any:
    """Learnable tokens: next = (3 * prev + 1) mod vocab, with 10% random tokens (loss settles near 0.8 nats)."""
    from pmakit.train.data import Corpus

    rng = np.random.default_rng(seed)
    noise, rnd = rng.random(n) < 0.1, rng.integers(0, vocab, n)
    out = np.empty(n, dtype=np.uint16)
    t = 0
    for i in range(n):
        t = int(rnd[i]) if noise[i] else (3 * t + 1) % vocab
        out[i] = t
    split = n * 9 // 10
    return Corpus(
        train=out[:split], val=out[split:], tokenizer_dir=None, val_bytes=None, vocab_size=vocab, files={}
    )


def tiny_trainer(run: Path, callbacks: list[Any], lr_burst: tuple[int, int, float] | None, **kw: Any) -> Any:
    """A 1-layer Llama trained at LR 3e-3, except steps first..last (1-based) at LR `high`."""
    from pmakit.train.loop import TrainConfig, Trainer
    from pmakit.train.model import ModelConfig

    cfg = TrainConfig(
        keep_checkpoints_at=kw.pop("keep_checkpoints_at", ()),
        model=ModelConfig(layers=1, hidden=32, heads=2, seq_len=32),
        batch_size=8,
        total_tokens=kw.pop("total_steps", 140) * TRAIN_TPS,
        lr=3e-3,
        warmup_tokens=10 * TRAIN_TPS,
        every_tokens=EVERY,
        average_last=3,
        eval_every=0,
        eval_batches=1,
        log_every=1,
        threads=1,
    )

    def schedule(tokens: float) -> float:  # the LR of the step that ends at `tokens`
        step = round(tokens / TRAIN_TPS)
        if lr_burst is not None and lr_burst[0] <= step <= lr_burst[1]:
            return lr_burst[2]
        return 3e-3

    return Trainer(cfg, run, corpus=tiny_corpus(), schedule=schedule, callbacks=callbacks, **kw)


def train_records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


DETECT = SpikeConfig(window=20, min_history=10, patience=3, warmup_tokens=20 * TRAIN_TPS)


def test_spike_recovery_rolls_back_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    rec = SpikeRecovery(RecoveryConfig(detector=DETECT, last=3))
    # LR 100x too high for steps 102-104: the weights after step 102 are the first bad ones, their loss is
    # logged with step 103; patience 3 -> detected at step 105, after the snapshot of step 104 was taken.
    trainer = tiny_trainer(run, [rec], (102, 104, 0.3), resume=False)
    trainer.fit()
    trainer.close()
    records = train_records(run)
    events = [r for r in records if r["kind"] == "event"]
    assert [e["event"] for e in events] == ["spike", "rollback"]
    spike, rollback = events
    # The first bad loss is step 103's; the onset rule may widen the start back by a step whose loss was merely
    # high (z > 3): earlier is the safe side. Patience 3 from step 103 -> detected at step 105.
    assert spike["detected_step"] == 105 and spike["start_step"] in (102, 103)
    # the weights of the step before the start made its loss: the boundary is one step earlier
    assert rollback["before_tokens"] == (spike["start_step"] - 1) * TRAIN_TPS
    # the last 3 snapshots strictly before it: steps 80, 88, 96
    assert [m["step"] for m in rollback["merged"]] == [80, 88, 96]
    assert [m["weight"] for m in rollback["merged"]] == pytest.approx([1 / 3] * 3)
    assert rollback["optimizer"] == "reset" and rollback["recovery"] == 1
    assert [Path(p).name for p in rollback["discarded"]] == ["step-00000104"]
    moved = run / "discarded" / f"spike-{spike['start_tokens']}" / "step-00000104"
    # recorded relative to the run, as it may be moved
    assert run / rollback["discarded"][0] == moved and (moved / "pmakit.json").exists()
    assert [m["path"] for m in rollback["merged"]] == [f"snapshots/step-{s:08d}" for s in (80, 88, 96)]

    # The run went on: snapshots on the same token grid (minus the discarded one), token counts consistent.
    snaps = discover(run / "snapshots")
    assert [s.tokens for s in snaps] == [k * EVERY for k in range(1, 18) if k != 13]
    assert all(s.step is not None and s.step * TRAIN_TPS == s.tokens for s in snaps)
    assert trainer.tokens == 140 * TRAIN_TPS and trainer.state.recoveries == 1
    # ... and back on track: the last 20 losses are near the pre-spike baseline, not the spike's.
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert spike["loss"] > spike["baseline"] + 1
    assert float(np.mean([losses[s] for s in range(121, 141)])) < spike["baseline"] + 0.3
    # The online merge after the recovery never averaged the discarded snapshot.
    assert 104 * TRAIN_TPS not in [t for t, _ in trainer.averager.window]

    # Offline, the log still shows that spike, and says it was already rolled back.
    with caplog.at_level(logging.WARNING, logger="pmakit.recover"):
        offline = recover(run, out=tmp_path / "offline", detector=DETECT)  # the same detector, offline
    assert offline.spike is not None and offline.spike.start_tokens == spike["start_tokens"]
    assert [s.step for s in offline.snapshots] == [80, 88, 96]
    assert "already rolled back during training" in caplog.text

    # Resuming the recovered run (a crash, then the same command) keeps saving on the same grid.
    resumed = tiny_trainer(run, [SpikeRecovery(RecoveryConfig(detector=DETECT))], None, total_steps=156)
    assert (resumed.tokens, resumed.state.recoveries) == (140 * TRAIN_TPS, 1)
    resumed.fit()
    resumed.close()
    assert [s.tokens for s in discover(run / "snapshots")][-3:] == [17 * EVERY, 18 * EVERY, 19 * EVERY]


def test_spike_recovery_keeps_the_pre_spike_optimizer_and_lowers_the_lr(tmp_path: Path) -> None:
    run = tmp_path / "run"
    config = RecoveryConfig(
        detector=DETECT, last=2, optimizer="keep-latest", lr_factor=0.01, lr_factor_tokens=35 * TRAIN_TPS
    )
    # LR 100x too high for 30 steps: only the lowered LR after the recovery keeps the run from spiking again.
    trainer = tiny_trainer(run, [SpikeRecovery(config)], (102, 131, 0.3), resume=False, total_steps=150)
    trainer.fit()
    trainer.close()
    records = train_records(run)
    events = [r for r in records if r["kind"] == "event"]
    assert [e["event"] for e in events] == ["spike", "rollback"], events
    rollback = events[1]
    assert rollback["optimizer"] == "loaded" and rollback["optimizer_policy"] == "keep-latest"
    assert (
        rollback["optimizer_from_tokens"] == rollback["merged"][-1]["tokens"]
    )  # the newest pre-spike snapshot
    r = rollback["step"]
    assert rollback["lr_factor"] == 0.01 and rollback["lr_factor_until"] == (r + 35) * TRAIN_TPS
    lrs = {x["step"]: x["lr"] for x in records if x["kind"] == "train"}
    for s in range(r + 1, 151):
        scheduled = 0.3 if s <= 131 else 3e-3
        assert lrs[s] == pytest.approx(scheduled * (0.01 if s <= r + 35 else 1.0)), s
    assert math.isfinite(trainer.score().loss)


def test_spike_recovery_stops_after_max_recoveries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec = SpikeRecovery(RecoveryConfig(detector=DETECT, max_recoveries=1))
    trainer = tiny_trainer(run, [rec], (102, 10_000, 0.3), resume=False)  # the LR stays far too high
    trainer.fit()
    trainer.close()
    events = [r for r in train_records(run) if r["kind"] == "event"]
    assert [e["event"] for e in events] == ["spike", "rollback", "spike", "stop"]
    assert "max_recoveries=1" in events[-1]["reason"] and "lower it" in events[-1]["reason"]
    assert trainer.tokens < 140 * TRAIN_TPS


def test_recover_output_resumes_in_the_trainer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = tiny_trainer(run, [], None, resume=False, total_steps=48, keep_checkpoints_at=(32 * TRAIN_TPS,))
    trainer.fit()
    trainer.close()
    out = tmp_path / "recovered"
    result = recover(run, out=out, before=40 * TRAIN_TPS, last=2, optimizer="keep-latest")
    assert [s.step for s in result.snapshots] == [24, 32]
    assert result.optimizer_from is not None and result.optimizer_from.tokens == 32 * TRAIN_TPS
    resumed = tiny_trainer(tmp_path / "run2", [], None, resume_from=out, total_steps=64)
    assert (resumed.step, resumed.tokens) == (32, 32 * TRAIN_TPS)
    resumed.fit()
    resumed.close()
    assert [s.step for s in discover(tmp_path / "run2" / "snapshots")] == [40, 48, 56, 64]


def test_spike_recovery_ignores_the_trainers_warmup_by_default() -> None:
    from types import SimpleNamespace

    rec = SpikeRecovery()
    rec.on_train_start(SimpleNamespace(config=SimpleNamespace(warmup_tokens=4096)))
    assert rec.detector.config.warmup_tokens == 4096
    explicit = SpikeRecovery(RecoveryConfig(detector=SpikeConfig(warmup_tokens=10)))
    explicit.on_train_start(SimpleNamespace(config=SimpleNamespace(warmup_tokens=4096)))
    assert explicit.detector.config.warmup_tokens == 10
    with pytest.raises(PmakitError, match="unknown optimizer policy"):
        RecoveryConfig(optimizer="keep")


def test_recover_finds_a_real_runs_spike_without_intervention(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = tiny_trainer(run, [], (102, 104, 0.3), resume=False, total_steps=112)  # no callback: it spikes
    trainer.fit()
    trainer.close()
    result = recover(run, out=tmp_path / "out", detector=DETECT)
    assert result.spike is not None and result.spike.start_step in (102, 103)
    assert result.before_tokens == (result.spike.start_step - 1) * TRAIN_TPS
    assert [s.step for s in result.snapshots] == [80, 88, 96]
    assert read_snapshot(tmp_path / "out").tokens == 96 * TRAIN_TPS


def test_the_printed_resume_command_runs_and_keeps_the_abandoned_timeline(tmp_path: Path) -> None:
    import shlex

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "train: {corpus: null, max_corpus_bytes: 300000, vocab_size: 300, val_fraction: 0.2, batch_size: 4,\n"
        "  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}, total_tokens: 5120, warmup_tokens: 0,\n"
        "  every_tokens: 1280, average_last: 2, eval_every: 1, eval_batches: 2, log_every: 1}\n"
    )
    run = tmp_path / "run"
    assert run_cli("train", cfg, "-o", run).returncode == 0
    proc = run_cli("recover", run / "snapshots", "--before", "3840", "--last", "2", "-o", tmp_path / "rec")
    assert proc.returncode == 0, proc.stderr
    hint = proc.stdout.rsplit("resume with: ", 1)[1].strip()
    assert hint.startswith("pmakit train --resume-from") and f"-o {run}" in hint
    done = run_cli(*shlex.split(hint)[1:])  # exactly the printed command, on the run's own saved config
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # one timeline, no duplicated steps
    rollback = [r for r in records if r.get("event") == "rollback"]
    assert len(rollback) == 1 and rollback[0]["step"] == 20
    abandoned = (run / rollback[0]["abandoned"]).read_text().splitlines()
    assert abandoned and all(json.loads(line)["step"] > 20 for line in abandoned)  # nothing lost
