"""Merge at scale: 1 vs 2 ranks (torchrun, gloo) and DCP inputs vs HF safetensors inputs, in one run.

    python benchmarks/bench_scale.py                 # `make bench-scale`: 4 x 0.44 GB, 3 repeats, warm and cold
    python benchmarks/bench_scale.py --layers 8 --n 8 --repeats 2   # bigger: 8 x 1.0 GB
    python benchmarks/bench_scale.py --modes warm --repeats 1        # a quick look

The same N bf16 Llama-shaped snapshots (bench_merge.py's layout: hidden 2048, intermediate 5632, vocab 32000) are
written twice: as HF safetensors and as DCP checkpoints (torch.distributed.checkpoint.save from one process, the
model at the top level as torchtitan saves it, with an optimizer entry beside it that the merge skips). Each
configuration runs the real command (`python -m pmakit merge`, or `python -m torch.distributed.run
--nproc-per-node 2 -m pmakit merge`), SMA of all N, bf16 output, fsync on. Runs are interleaved (repeat -> mode ->
configuration) so that load from other processes spreads over all of them.

Reported per configuration: median wall time of the whole command (process start-up included: torch's import
costs seconds on a loaded machine, twice over under torchrun), the merge time the command itself reports (from
planning to the rename), their ratios to the 1-rank HF -> HF run, and the peak anonymous memory (RssAnon, sampled
every 20 ms) of the largest process (a rank). warm: inputs read into the page cache before each run; cold: inputs
evicted (posix_fadvise DONTNEED) before each run. Data (default ./bench-data) is reused between runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_merge import evict, llama_layout  # noqa: E402
from pmakit.formats.safetensors_io import save_file  # noqa: E402
from pmakit.snapshot import write_metadata  # noqa: E402

CONFIGS = {
    "hf-1rank": ("hf", 1, "safetensors"),
    "hf-2ranks": ("hf", 2, "safetensors"),
    "dcp-1rank": ("dcp", 1, "safetensors"),
    "dcp-2ranks": ("dcp", 2, "safetensors"),
    "hf-to-dcp-1rank": ("hf", 1, "dcp"),
}


def make_snapshots(data: Path, args: argparse.Namespace) -> dict[str, Path]:
    """N snapshots in both formats (reused when present)."""
    shapes = llama_layout(args.layers, 2048, 5632, 32000, 4, 16)
    tag = f"scale-L{args.layers}-N{args.n}"
    runs = {"hf": data / tag / "hf", "dcp": data / tag / "dcp"}
    for i in range(args.n):
        hf, dcp_dir = runs["hf"] / f"step-{i + 1:04d}", runs["dcp"] / f"step-{i + 1:04d}"
        if (hf / "pmakit.json").exists() and (dcp_dir / "pmakit.json").exists():
            continue
        g = torch.Generator().manual_seed(i)
        tensors = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
        hf.mkdir(parents=True, exist_ok=True)
        save_file(tensors, hf / "model.safetensors")
        write_metadata(hf, step=(i + 1) * 1000, tokens=(i + 1) * 10**9)
        import torch.distributed.checkpoint as dcp

        dcp_dir.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({**tensors, "optimizer": {"step": i}}, checkpoint_id=dcp_dir, no_dist=True)
        write_metadata(dcp_dir, step=(i + 1) * 1000, tokens=(i + 1) * 10**9)
        size = (hf / "model.safetensors").stat().st_size
        print(f"  made {hf.name} as HF and DCP ({size / 1e9:.2f} GB each)", flush=True)
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_rss_anon(pid: int) -> int:
    """The largest RssAnon among the process and its descendants (the ranks under torchrun)."""
    try:
        import psutil
    except ImportError:
        pids = [pid]
    else:
        try:
            pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            pids = [pid]
    best = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    best = max(best, int(line.split()[1]) * 1024)
        except OSError:
            pass
    return best


def run(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, merge seconds the command reports, peak RssAnon of its largest process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _tree_rss_anon(proc.pid))
        time.sleep(0.02)
    wall = time.perf_counter() - start
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed:\n{err[-3000:]}")
    match = re.search(r" in ([0-9.]+) s, reading", out)
    return wall, float(match.group(1)) if match else float("nan"), peak


def command(run_dir: Path, out: Path, ranks: int, out_format: str, n: int) -> list[str]:
    merge = ["merge", str(run_dir), "--last", str(n), "-o", str(out), "--force", "--format", out_format]
    if ranks == 1:
        return [sys.executable, "-m", "pmakit", *merge]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    return [*launcher, "--master-port", str(_free_port()), "-m", "pmakit", *merge]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data", help="Where snapshots are kept.")
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers (2: 0.22B parameters).")
    parser.add_argument("--n", type=int, default=4, help="Snapshots merged.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each configuration and mode.")
    parser.add_argument("--modes", nargs="+", default=["warm", "cold"], choices=["warm", "cold"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()

    runs = make_snapshots(args.data, args)
    inputs = {fmt: sorted(p for p in d.iterdir() if p.is_dir()) for fmt, d in runs.items()}
    size = sum(f.stat().st_size for p in inputs["hf"] for f in p.iterdir())
    print(f"{args.n} snapshots, {size / 1e9:.2f} GB of bf16 input per format; load {os.getloadavg()[0]:.1f}")
    out_root = args.data / "scale-out"
    results: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for r in range(args.repeats):
        for mode in args.modes:
            for name in args.configs:
                fmt, ranks, out_format = CONFIGS[name]
                if mode == "cold":
                    evict(inputs[fmt])
                else:
                    for p in inputs[fmt]:
                        for f in p.iterdir():
                            with open(f, "rb") as fh:
                                while fh.read(64 * 2**20):
                                    pass
                wall, merged, peak = run(command(runs[fmt], out_root / name, ranks, out_format, args.n))
                results.setdefault((mode, name), []).append((wall, merged, peak))
                print(
                    f"  [{r + 1}/{args.repeats}] {mode:4} {name:16} wall {wall:6.2f} s  merge {merged:6.2f} s  "
                    f"anon {peak / 2**20:6.0f} MiB",
                    flush=True,
                )
    print(f"\nmedians over {args.repeats} run(s); load average now {os.getloadavg()[0]:.1f} (2 cores)")
    print(
        f"{'mode':5} {'configuration':16} {'wall s':>7} {'x 1-rank':>8} {'merge s':>8} {'x 1-rank':>8} "
        f"{'GB/s in':>8} {'anon MiB':>9}"
    )
    for mode in args.modes:
        base = results.get((mode, "hf-1rank"))
        for name in args.configs:
            rows = results[(mode, name)]
            wall = statistics.median(w for w, _, _ in rows)
            merged = statistics.median(m for _, m, _ in rows)
            peak = max(p for _, _, p in rows)
            ratio_wall = wall / statistics.median(w for w, _, _ in base) if base else float("nan")
            ratio_merge = merged / statistics.median(m for _, m, _ in base) if base else float("nan")
            print(
                f"{mode:5} {name:16} {wall:7.2f} {ratio_wall:8.2f} {merged:8.2f} {ratio_merge:8.2f} "
                f"{size / merged / 1e9:8.2f} {peak / 2**20:9.0f}"
            )
    shutil.rmtree(out_root, ignore_errors=True)


if __name__ == "__main__":
    main()
