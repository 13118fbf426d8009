"""A user's own training loop (docs/training.md's ten lines) with `torch` imported before `pmakit` and after it, on a
busy machine, in one run.

    python benchmarks/bench_ownloop.py                 # `make bench-ownloop`: 1 busy process a core, 2 repeats
    python benchmarks/bench_ownloop.py --busy 0        # the same on the machine as it is

libgomp (torch's OpenMP) reads OMP_WAIT_POLICY once, when torch loads: importing pmakit first sets it to PASSIVE
(threads that wait sleep); importing torch first leaves the default, where a thread that waits at the end of every
parallel op spins for a while, on a core another process needs. This runs the docs' loop (a small language model,
AdamW, a SnapshotSaver with an OnlineAverager fed from it, the merged model evaluated at every snapshot) in a fresh
interpreter per run, each order in turn (interleaved repeats), while ``--busy`` processes per core spin in pure
Python (what other jobs on a shared machine do), and reports the median wall time of each order and their ratio.
It also checks that the torch-first run printed pmakit's warning. No OMP_WAIT_POLICY is passed to the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOOP = """
import {first}
import {second}
import json, sys, time
import torch
from pmakit._env import spinning
from pmakit.online import OnlineAverager
from pmakit.saver import SnapshotSaver

class Output:
    def __init__(self, loss):
        self.loss = loss

class LM(torch.nn.Module):  # a small language model: embedding, an MLP block, a head
    def __init__(self, vocab=2048, hidden=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids):
        h = self.embed(input_ids[:, :-1])
        logits = self.head(h + self.mlp(h))
        return Output(torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids[:, 1:].flatten()))

torch.manual_seed(0)
model = LM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches = [{{"input_ids": torch.randint(0, 2048, (8, 129))}} for _ in range({steps})]
def evaluate(m):
    with torch.no_grad():
        return m(**batches[0]).loss.item()

start = time.perf_counter()
# docs/training.md's loop, as it stands there
averager = OnlineAverager(n=10, method="sma")
saver = SnapshotSaver(sys.argv[1], every_tokens={every},
                      on_save=[lambda snap, state: averager.update(state, tokens=snap.tokens, path=snap.path)])
tokens = 0
for step, batch in enumerate(batches, start=1):
    loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    tokens += batch["input_ids"].numel()
    if saver.maybe_save(model, tokens=tokens, step=step, loss=loss.item()):
        saver.wait()
        with averager.swapped_in(model):
            merged_loss = evaluate(model)
saver.close()
print(json.dumps({{"seconds": time.perf_counter() - start, "spinning": spinning(), "threads": torch.get_num_threads()}}))
"""

BUSY = "while True: pass"


def run_loop(first: str, second: str, steps: int, every: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT / "src")
    code = LOOP.format(first=first, second=second, steps=steps, every=every)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", code, str(Path(d) / "snapshots")],
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the loop failed ({first} first):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "wall": wall, "warned": "torch was imported before pmakit" in proc.stderr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps (8 x 128 tokens each)")
    ap.add_argument("--every", type=int, default=10 * 8 * 129, help="tokens between snapshots")
    ap.add_argument("--busy", type=float, default=1.0, help="busy processes per core (spinning in Python)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (medians reported)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = [
        subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.DEVNULL)
        for _ in range(round(args.busy * cores))
    ]
    orders = {"torch first": ("torch", "pmakit"), "pmakit first": ("pmakit", "torch")}
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in orders}
    loads = [os.getloadavg()[0]]
    try:
        time.sleep(1.0 if busy else 0.0)  # let the load start
        for rep in range(args.repeats):
            for name, (first, second) in orders.items():
                r = run_loop(first, second, args.steps, args.every)
                runs[name].append(r)
                loads.append(os.getloadavg()[0])
                print(
                    f"  [{rep + 1}/{args.repeats}] {name:12} loop {r['seconds']:7.2f} s (process {r['wall']:.2f} s), "
                    f"spinning {r['spinning']}, warned {r['warned']}, load {loads[-1]:.1f}",
                    flush=True,
                )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    report(args, cores, len(busy), runs, loads)


def report(
    args: argparse.Namespace,
    cores: int,
    busy: int,
    runs: dict[str, list[dict[str, object]]],
    loads: list[float],
) -> None:
    print(
        f"\n{args.steps} steps of docs/training.md's loop (a snapshot every {args.every} tokens, merged and "
        f"evaluated), {args.repeats} interleaved repeats; {cores} cores, {busy} busy processes started here, load "
        f"average {min(loads):.1f}-{max(loads):.1f} during the run"
    )
    print(f"{'order':13} {'median s':>9} {'range s':>15} {'torch threads':>14} {'warned':>7}")
    medians = {}
    for name, rs in runs.items():
        ts = [float(str(r["seconds"])) for r in rs]
        medians[name] = statistics.median(ts)
        warned = all(bool(r["warned"]) for r in rs)
        print(
            f"{name:13} {medians[name]:9.2f} {min(ts):7.2f}-{max(ts):7.2f} {rs[0]['threads']!s:>14} "
            f"{'yes' if warned else 'no':>7}"
        )
    print(f"torch first / pmakit first: {medians['torch first'] / medians['pmakit first']:.2f}x")


if __name__ == "__main__":
    main()
