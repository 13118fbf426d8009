"""How far the demo's training is from this machine's limit: achieved FLOP/s against the measured matmul peak.

    python benchmarks/bench_flops.py            # `make bench-flops`: the demo preset's model, 2 threads
    python benchmarks/bench_flops.py --steps 10 --rounds 2

Peak: the best of a few ``torch.matmul`` of large square matrices (fp32; bf16 beside it, for what autocast could
reach on CPUs with native bf16), on the same threads as training. Achieved: the training step of ``make demo``
(the demo preset's model, batch and optimizer; random token ids: the cost of a step does not depend on the text),
best and median over rounds, with the FLOPs of a step counted two ways:

- estimate (PaLM's, Chowdhery et al. 2022, App. B, as nanoGPT's ``estimate_mfu``): 6 N per token for the weights
  (N = parameters in matmuls: every block's weights and the output head; the input embedding is a lookup) plus
  12 L d T for attention (L layers, width d, context T; no discount for the causal mask);
- counted: ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward (matmuls; attention where it
  counts the kernel, see the printed note).

Then where a step's time goes (torch.profiler over a few steps, outside the timed rounds): matmul kernels,
attention kernels, everything else (norms, RoPE, softmax/cross-entropy, the optimizer), and the matmuls' own rate.

The ratio achieved / peak is the model FLOPs utilisation (MFU) against this machine's measured peak rather than a
datasheet's. Peak and training alternate in rounds so that load from other processes touches both: on a shared
machine the best of the rounds is the figure to compare, and the load average is printed with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pmakit.config import load  # noqa: E402
from pmakit.train.loop import TrainConfig  # noqa: E402
from pmakit.train.model import build_model, count_parameters  # noqa: E402


def matmul_flops_per_second(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Best FLOP/s of ``repeats`` products of two n x n matrices (2 n^3 FLOPs each), after a warm-up."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    c = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (forward + backward) of the demo model."""

    matmul_params: int
    estimate: float
    """6 N T_batch + 12 L d T T_batch (PaLM's estimate)."""
    counted: float
    """FlopCounterMode's total over one forward + backward."""
    counted_attention: float
    """Its attention kernels' part (0 where it does not count the CPU kernel)."""


def step_flops(cfg: TrainConfig) -> StepFlops:
    model = build_model(cfg.model, cfg.vocab_size, seed=cfg.seed)
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    # The input embedding is a lookup; tied, its weights still do the output head's matmul (counted once).
    n = count_parameters(model) - (0 if tied else embedding.numel())
    m = cfg.model
    tokens = cfg.batch_size * m.seq_len
    estimate = 6 * n * tokens + 12 * m.layers * m.hidden * m.seq_len * tokens
    batch = torch.randint(0, cfg.vocab_size, (cfg.batch_size, m.seq_len + 1))
    with FlopCounterMode(display=False) as counter:
        loss_of(model, batch).backward()
    per_op = counter.get_flop_counts()["Global"]
    attention = sum(v for op, v in per_op.items() if "attention" in str(op))
    return StepFlops(n, estimate, counter.get_total_flops(), attention)


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def step_seconds(cfg: TrainConfig, steps: int, bf16: bool = False) -> float:
    """Median wall seconds of a training step as ``make demo`` takes it (AdamW, clipping), after a warm-up step;
    ``bf16``: the forward and backward under CPU bf16 autocast (fp32 weights and optimizer), as ``precision: bf16``."""
    model = build_model(cfg.model, cfg.vocab_size, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, foreach=True)
    gen = torch.Generator().manual_seed(1)
    times = []
    for step in range(steps + 1):
        batch = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.model.seq_len + 1), generator=gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_by_kind(cfg: TrainConfig, steps: int = 3) -> dict[str, float]:
    """Seconds per step in matmul kernels, attention kernels and everything else (torch.profiler's self time of
    each op over ``steps`` steps after a warm-up; outside the timed rounds, which run without a profiler)."""
    model = build_model(cfg.model, cfg.vocab_size, seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, foreach=True)
    batch = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.model.seq_len + 1))

    def step() -> None:
        loss_of(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    kinds = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for event in prof.key_averages():
        kind = (
            "matmul"
            if event.key in MATMULS
            else "attention"
            if "scaled_dot_product" in event.key
            else "other"
        )
        kinds[kind] += event.self_cpu_time_total / 1e6 / steps
    return kinds


MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", help="Model size and batch from this preset.")
    ap.add_argument("--steps", type=int, default=20, help="Training steps timed per round.")
    ap.add_argument("--rounds", type=int, default=3, help="Alternating rounds of peak and training.")
    ap.add_argument("--size", type=int, default=2048, help="Side of the square matrices of the peak.")
    ap.add_argument("--threads", type=int, default=2, help="Torch threads (the demo uses torch's default).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig.from_dict(load(None, args.preset, "demo")["train"])
    flops = step_flops(cfg)
    peaks: dict[str, list[float]] = {"fp32": [], "bf16": []}
    steps: list[float] = []
    autocast: list[float] = []
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        peaks["fp32"].append(matmul_flops_per_second(args.size, torch.float32, 5))
        peaks["bf16"].append(matmul_flops_per_second(args.size, torch.bfloat16, 5))
        steps.append(step_seconds(cfg, args.steps))
        autocast.append(step_seconds(cfg, args.steps, bf16=True))
        loads.append(os.getloadavg()[0])
        print(
            f"  round {r + 1}: matmul fp32 {peaks['fp32'][-1] / 1e9:6.1f} GFLOP/s, bf16 {peaks['bf16'][-1] / 1e9:6.1f} "
            f"GFLOP/s; training step {1e3 * steps[-1]:6.1f} ms, with bf16 autocast {1e3 * autocast[-1]:6.1f} ms  "
            f"(load {loads[-1]:.1f})",
            flush=True,
        )
    report(cfg, flops, peaks, steps, loads, args.threads)
    ratios = [a / s for a, s in zip(autocast, steps)]
    print(
        f"bf16 autocast (train.precision bf16; the demo's `auto` uses it where the CPU has native bf16): a step takes "
        f"{statistics.median(ratios):.2f}x the fp32 step (median of the rounds' ratios; range "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )
    kinds = time_by_kind(cfg)
    total = sum(kinds.values())
    matmul_rate = 6 * flops.matmul_params * cfg.batch_size * cfg.model.seq_len / kinds["matmul"]
    print(
        f"where a step's time goes (torch.profiler, {1e3 * total:.0f} ms profiled): "
        + ", ".join(f"{k} {1e3 * v:.0f} ms ({100 * v / total:.0f}%)" for k, v in kinds.items())
        + f"; the matmuls themselves run at {matmul_rate / 1e9:.0f} GFLOP/s = "
        f"{100 * matmul_rate / max(peaks['fp32']):.0f}% of the fp32 peak (narrow {cfg.model.hidden}-wide shapes)"
    )


def report(
    cfg: TrainConfig,
    flops: StepFlops,
    peaks: dict[str, list[float]],
    steps: list[float],
    loads: list[float],
    threads: int,
) -> None:
    tokens = cfg.batch_size * cfg.model.seq_len
    peak = max(peaks["fp32"])
    print(
        f"\nmodel: {flops.matmul_params / 1e6:.3f}M parameters in matmuls, {tokens} tokens per step, {threads} threads;"
        f" load average {min(loads):.1f}-{max(loads):.1f} (a shared machine: best of the rounds compared)"
    )
    attention = (
        "" if flops.counted_attention else " (no attention: it does not count the CPU attention kernel)"
    )
    print(
        f"FLOPs per step: estimate 6N + 12LdT = {flops.estimate / 1e9:.2f} G; FlopCounterMode {flops.counted / 1e9:.2f} G"
        f"{attention}"
    )
    print(
        f"matmul peak (best of the rounds): fp32 {peak / 1e9:.1f} GFLOP/s, bf16 {max(peaks['bf16']) / 1e9:.1f} GFLOP/s"
    )
    print(f"{'step':<7}{'ms':>8}{'tokens/s':>10}{'GFLOP/s (est.)':>16}{'of fp32 peak':>14}")
    for label, seconds in (("best", min(steps)), ("median", statistics.median(steps))):
        achieved = flops.estimate / seconds
        print(
            f"{label:<7}{1e3 * seconds:>8.1f}{tokens / seconds:>10.0f}{achieved / 1e9:>16.1f}"
            f"{100 * achieved / peak:>13.1f}%"
        )


if __name__ == "__main__":
    main()
