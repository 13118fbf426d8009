"""Training overhead of pmakit: snapshots every V tokens + the online merge, against the same loop without them.

    python benchmarks/bench_train.py                 # the demo preset's model and V, 3 interleaved repeats
    python benchmarks/bench_train.py --steps 60 --repeats 2

Both arms run the same steps on the same random batches (tokens are random ids: the cost of a step does not depend
on the text). Arm "pmakit" adds SnapshotSaver.maybe_save every V tokens (CPU copy at the step, write on a
background thread, fsync) and an OnlineAverager fed by the saver (SMA over N). Evaluation is left out of both: it
is a choice of how often to look, not a cost of saving and averaging. Reports the median wall time of each arm,
their ratio, and the memory the averager holds.

The wall-clock ratio swings by several percent between repeats on a shared machine, so the target is measured in
process: the time the training thread itself spends in ``maybe_save`` (the CPU copy, and any wait for a write still
in flight), per step and as a share of the plain arm's step time (target <= 1%), from ``SnapshotSaver.timings``;
and the writer thread's CPU time (write + fsync + the averager's update), which competes with training for cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pmakit.config import load  # noqa: E402
from pmakit.online import OnlineAverager  # noqa: E402
from pmakit.saver import SaverTimings, SnapshotSaver  # noqa: E402
from pmakit.train.loop import TrainConfig  # noqa: E402
from pmakit.train.model import build_model, count_parameters  # noqa: E402


def run_arm(
    cfg: TrainConfig, steps: int, with_pmakit: bool, work: Path
) -> tuple[float, int, SaverTimings | None]:
    """Wall seconds of ``steps`` training steps; bytes the averager holds (0 without pmakit); the saver's timers."""
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.vocab_size, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, foreach=True)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.model.seq_len + 1), generator=gen)
        for _ in range(8)
    ]
    averager = saver = None
    if with_pmakit:
        shutil.rmtree(work, ignore_errors=True)
        averager = OnlineAverager(cfg.average_last, cfg.average_method)
        saver = SnapshotSaver(
            work,
            cfg.every_tokens,
            on_save=[lambda snap, state: averager.update(state, tokens=snap.tokens, path=snap.path)],
        )
    tokens = 0
    start = time.perf_counter()
    for step in range(1, steps + 1):
        b = batches[step % len(batches)]
        logits = model(input_ids=b[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += cfg.tokens_per_step
        if saver is not None:
            saver.maybe_save(model, tokens=tokens, step=step, lr=cfg.lr, loss=loss.item())
    if saver is not None:
        saver.wait()  # the last write counts too
        saver.close()
    seconds = time.perf_counter() - start
    if saver is None or averager is None:
        return seconds, 0, None
    return seconds, averager.nbytes, saver.timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", help="Model size, batch and V from this preset.")
    ap.add_argument("--steps", type=int, default=120, help="Steps per arm and repeat.")
    ap.add_argument("--repeats", type=int, default=3, help="Interleaved repeats of both arms.")
    ap.add_argument("--threads", type=int, default=2, help="Torch threads.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig.from_dict(load(None, args.preset, "demo")["train"])
    params = count_parameters(build_model(cfg.model, cfg.vocab_size))
    snaps = args.steps * cfg.tokens_per_step // cfg.every_tokens
    print(
        f"model {params / 1e6:.2f}M parameters, {cfg.tokens_per_step} tokens/step, V = {cfg.every_tokens} tokens "
        f"({cfg.every_tokens // cfg.tokens_per_step} steps): {snaps} snapshots per arm, "
        f"{args.repeats} repeats, {args.threads} threads",
        flush=True,
    )
    times: dict[str, list[float]] = {"plain": [], "pmakit": []}
    held = 0
    timings: list[SaverTimings] = []
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for r in range(args.repeats):
            for arm in ("plain", "pmakit") if r % 2 == 0 else ("pmakit", "plain"):
                seconds, nbytes, timing = run_arm(cfg, args.steps, arm == "pmakit", Path(tmp) / "snapshots")
                times[arm].append(seconds)
                held = max(held, nbytes)
                timings += [timing] if timing is not None else []
                print(f"  repeat {r + 1} {arm:>6}: {seconds:7.2f} s", flush=True)
    plain, pma = statistics.median(times["plain"]), statistics.median(times["pmakit"])
    print(f"\n{'arm':<8}{'median s':>10}{'ratio':>8}")
    print(f"{'plain':<8}{plain:>10.2f}{1.0:>8.3f}")
    print(f"{'pmakit':<8}{pma:>10.2f}{pma / plain:>8.3f}")
    print(
        f"overhead of saving + online averaging: {100 * (pma / plain - 1):+.1f}% of training wall time "
        f"(wall clock, noisy); averager holds {held / 2**20:.1f} MiB (model fp32: {params * 4 / 2**20:.1f} MiB)"
    )
    report_in_process(timings, args.steps, plain, snaps)


def report_in_process(timings: list[SaverTimings], steps: int, plain_seconds: float, snaps: int) -> None:
    """The training thread's time in the saver per step, as a share of a plain step (median over repeats)."""
    step = plain_seconds / steps
    caller = statistics.median(t.caller_seconds for t in timings) / steps
    writer = statistics.median(t.writer_cpu_seconds for t in timings)
    callbacks = statistics.median(t.callback_cpu_seconds for t in timings)
    print(
        f"in process, training thread: {1e3 * caller:.2f} ms per step in maybe_save = {100 * caller / step:.2f}% "
        f"of a plain step ({1e3 * step:.1f} ms; target <= 1%)"
    )
    print(
        f"writer thread CPU: {1e3 * writer / max(snaps, 1):.1f} ms per snapshot, of which the online averager "
        f"{1e3 * callbacks / max(snaps, 1):.1f} ms = {100 * writer / steps / step:.2f}% of a step's wall time if it "
        "takes a core from training"
    )


if __name__ == "__main__":
    main()
