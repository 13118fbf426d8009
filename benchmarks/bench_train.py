"""Training overhead of pmakit: snapshots every V tokens + the online merge, against the same loop without them.

    python benchmarks/bench_train.py                 # the demo preset's model and V, 3 interleaved repeats
    python benchmarks/bench_train.py --steps 60 --repeats 2

Both arms run the same steps on the same random batches (tokens are random ids: the cost of a step does not depend
on the text). Arm "pmakit" adds the averaging hook the trainer uses (``pmakit.train.averaging.Averaging``): a
snapshot every V tokens (CPU copy at the step, write on a background thread, fsync), the online averager fed by it
(the preset's method and N), a metrics record per snapshot. Evaluation is left out of both: it is a choice of how
often to look, not a cost of saving and averaging.

The wall-clock ratio of the two arms swings by several percent between repeats on a shared machine, too noisy for
a 1% goal, so the target is measured in process: the training thread's own time in ``Averaging.step`` (the copy off
the model, any wait for a write still in flight, the record), per step and as a share of the same run's step time
(target <= 1%); and the writer thread's CPU time (write + fsync + the online averager's update, from
``SnapshotSaver.timings``), which competes with training for cores. The wall-clock arms stay as a cross-check.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pmakit.config import load  # noqa: E402
from pmakit.saver import SaverTimings  # noqa: E402
from pmakit.train.averaging import Averaging  # noqa: E402
from pmakit.train.loop import TrainConfig  # noqa: E402
from pmakit.train.model import build_model, count_parameters  # noqa: E402


@dataclass
class Arm:
    """One arm's run: wall seconds of its steps, and (with pmakit) the hook's in-process timers."""

    seconds: float
    held_bytes: int = 0
    hook_seconds: float = 0.0
    """Training-thread wall time in ``Averaging.step`` (the due check, the copy off the model, the record)."""
    saver: SaverTimings | None = None


def run_arm(cfg: TrainConfig, steps: int, with_pmakit: bool, work: Path) -> Arm:
    """``steps`` training steps, with or without the averaging hook the trainer uses (``Averaging``)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.vocab_size, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, foreach=True)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.model.seq_len + 1), generator=gen)
        for _ in range(8)
    ]
    hook = None
    if with_pmakit:
        shutil.rmtree(work, ignore_errors=True)
        # As the trainer builds it, minus evaluation (eval_every=0: how often to look is not a cost of saving).
        hook = Averaging(
            work, cfg.every_tokens, last=cfg.average_last, method=cfg.average_method, alpha=cfg.average_alpha,
            eval_every=0, keep_last=cfg.keep_last,
        )  # fmt: skip
        hook.start(None, 0, rebuild=False)
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
        if hook is not None:
            hook.step(model, tokens=tokens, step=step, lr=cfg.lr, loss=loss.item())
    if hook is None:
        return Arm(time.perf_counter() - start)
    hook.close()  # the last write counts too
    seconds = time.perf_counter() - start
    return Arm(seconds, hook.averager.nbytes, hook.step_seconds, hook.started_saver.timings)


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
    arms: dict[str, list[Arm]] = {"plain": [], "pmakit": []}
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        for r in range(args.repeats):
            for arm in ("plain", "pmakit") if r % 2 == 0 else ("pmakit", "plain"):
                result = run_arm(cfg, args.steps, arm == "pmakit", Path(tmp) / "snapshots")
                arms[arm].append(result)
                print(f"  repeat {r + 1} {arm:>6}: {result.seconds:7.2f} s", flush=True)
    plain = statistics.median(a.seconds for a in arms["plain"])
    pma = statistics.median(a.seconds for a in arms["pmakit"])
    held = max(a.held_bytes for a in arms["pmakit"])
    print(f"\n{'arm':<8}{'median s':>10}{'ratio':>8}")
    print(f"{'plain':<8}{plain:>10.2f}{1.0:>8.3f}")
    print(f"{'pmakit':<8}{pma:>10.2f}{pma / plain:>8.3f}")
    print(
        f"cross-check, wall clock (noisy on a shared machine): saving + online averaging {100 * (pma / plain - 1):+.1f}%"
        f" of training time; averager holds {held / 2**20:.1f} MiB (model fp32: {params * 4 / 2**20:.1f} MiB)"
    )
    report_in_process(arms["pmakit"], args.steps, snaps)


def report_in_process(runs: list[Arm], steps: int, snaps: int) -> None:
    """Per repeat, the training thread's time in the hook as a share of that same run's step time (a ratio of two
    timers of one process, so load from other processes moves both), and the writer thread's CPU; the median."""

    def median(f: Callable[[Arm], float]) -> float:
        return statistics.median(f(a) for a in runs)

    step = median(lambda a: a.seconds / steps)
    share = median(lambda a: a.hook_seconds / a.seconds)
    per_step = median(lambda a: a.hook_seconds / steps)
    copy = median(lambda a: a.saver.copy_seconds / max(a.saver.saves, 1) if a.saver else 0.0)
    wait = median(lambda a: a.saver.wait_seconds / steps if a.saver else 0.0)
    writer = median(lambda a: a.saver.writer_cpu_seconds / max(a.saver.saves, 1) if a.saver else 0.0)
    update = median(lambda a: a.saver.callback_cpu_seconds / max(a.saver.saves, 1) if a.saver else 0.0)
    writer_share = median(lambda a: a.saver.writer_cpu_seconds / a.seconds if a.saver else 0.0)
    print(
        f"in process, training thread: {1e3 * per_step:.2f} ms per step in the averaging hook = {100 * share:.2f}% of "
        f"the step time ({1e3 * step:.1f} ms; target <= 1%); the copy off the model {1e3 * copy:.2f} ms per "
        f"snapshot, waiting for the previous write {1e3 * wait:.3f} ms per step"
    )
    print(
        f"writer thread CPU: {1e3 * writer:.1f} ms per snapshot ({snaps} per run), of which the online averager's "
        f"update {1e3 * update:.1f} ms; {100 * writer_share:.2f}% of the run's wall time, taken from a core "
        "training could use"
    )


if __name__ == "__main__":
    main()
