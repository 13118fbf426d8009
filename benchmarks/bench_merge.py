"""Merge throughput and memory: pmakit vs the I/O floor, a naive load-all baseline and mergekit, in one run.

    python benchmarks/bench_merge.py          # `make bench`: 8 x 0.61 GB (4 layers), 2 repeats: ~5 min idle, ~12 min*
    python benchmarks/bench_merge.py --full   # the issue's size: 8 x 1.61 GB (15 layers, 0.8B params): ~30 min*
    python benchmarks/bench_merge.py --full --n 16 --skip naive mergekit cold --repeats 1   # memory at N=16
    python benchmarks/bench_merge.py --layers 2 --n 4 --repeats 1   # a quick look
    python benchmarks/bench_merge.py --full --cuda --skip naive mergekit cold timed   # on a GPU machine

(*) on this project's 2-core machine at load average ~10 (other jobs); naive and mergekit take most of it, and
`--skip naive mergekit` leaves the floor and pmakit only. The first run also installs mergekit (~1 min).

Every method merges the same N bf16 Llama-shaped snapshots (hidden 2048, intermediate 5632, vocab 32000, GQA 16/4
heads; SMA, fp32 accumulation, bf16 output). Runs are interleaved (repeat -> mode -> method) so that load from other
processes spreads over all methods. The table reports the median wall time (and the range), its ratio to the floor
measured in the same run, CPU seconds (user + sys of the process and its children) and the cores that makes over the
wall time, and the peak anonymous memory
(RssAnon sampled every 10 ms from /proc: mmapped file pages are the page cache's, not the process's).

warm: inputs read into the page cache right before each run; floor = `cat` of every input to /dev/null plus `cp` of
      one input-sized file as the output through the page cache, no fsync (pmakit writes its output with
      O_DIRECT and fsyncs it; mergekit and naive write through the page cache and do not fsync).
cold: every input evicted from the page cache (posix_fadvise DONTNEED) before each run; floor = the same, cold.
timed: `pmakit merge` again with the engine's in-process timers on (``pmakit.merge.stream.timed``; same bytes, its
      wall time beside the plain run shows what they cost): after the table, where its median run's time went,
      thread by thread: the calling thread's reads and waits, the workers' bf16->fp32 accumulate and cast + NaN/Inf
      check (wall and CPU, page faults), the writer's writes, fsync and idle time, the hasher thread's sha256
      (beside the writes). Python's start-up and `import torch` (~1.5 s CPU here) are in pmakit's wall time and
      outside the streaming passes.
mergekit 0.1.5 is installed into its own venv under the data directory, with torch pinned to 2.13.0 so that pip
never downloads another torch. Data (default ./bench-data, git-ignored) is reused between runs; delete it after.
On a shared machine the figures move with the other processes' load: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pmakit.formats.safetensors_io import OutputTensor, Shard, ShardWriter  # noqa: E402
from pmakit.snapshot import write_metadata  # noqa: E402


def llama_layout(
    layers: int, hidden: int, intermediate: int, vocab: int, kv_heads: int, heads: int
) -> dict[str, tuple[int, ...]]:
    kv = hidden // heads * kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def make_snapshots(data: Path, args: argparse.Namespace) -> list[Path]:
    shapes = llama_layout(args.layers, args.hidden, args.intermediate, args.vocab, args.kv_heads, args.heads)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    shards = getattr(args, "shards", 1)
    tag = f"L{args.layers}-H{args.hidden}-I{args.intermediate}-V{args.vocab}" + (
        f"-S{shards}" if shards > 1 else ""
    )
    paths = []
    for i in range(args.n):
        d = data / tag / f"step-{i + 1:04d}"
        paths.append(d)
        if (d / "pmakit.json").exists():
            continue
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(i)
        files = _split(shapes, shards)
        for name, group in files.items():
            writer = ShardWriter(
                d / name, Shard(name, tuple(OutputTensor(k, torch.bfloat16, s) for k, s in group))
            )
            for k, s in group:
                writer.write(k, (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16).reshape(-1))
            writer.close(fsync=False)
        if shards > 1:  # the index HF writes beside its shards
            weight_map = {k: name for name, group in files.items() for k, _ in group}
            index = {
                "metadata": {"total_size": sum(2 * math.prod(s) for s in shapes.values())},
                "weight_map": weight_map,
            }
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "config.json").write_text(json.dumps(config))
        write_metadata(d, step=(i + 1) * 1000, tokens=(i + 1) * 10**9)
        size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        print(f"  made {d} ({size / 1e9:.2f} GB in {shards} file(s))", flush=True)
    return paths


def _split(shapes: dict[str, tuple[int, ...]], shards: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The tensors in order, cut into ``shards`` files of about equal bytes, named as HF names its shards."""
    if shards == 1:
        return {"model.safetensors": list(shapes.items())}
    total = sum(math.prod(s) for s in shapes.values())
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    done = 0
    for k, s in shapes.items():
        if done >= total * len(files) / shards and len(files) < shards:
            files.append([])
        files[-1].append((k, s))
        done += math.prod(s)
    return {f"model-{j + 1:05d}-of-{len(files):05d}.safetensors": group for j, group in enumerate(files)}


def evict(paths: list[Path]) -> None:
    """Drop these files from the page cache."""
    for p in paths:
        for f in p.rglob("*") if p.is_dir() else [p]:
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd) if f.stat().st_size else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> tuple[float, int]:
    """Wall seconds and peak RssAnon bytes of a command (sampled every 10 ms); killed after ``timeout`` s."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass
        if timeout is not None and time.perf_counter() - start > timeout:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{cmd[:3]} took over {timeout:.0f} s: killed")
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
    return seconds, peak


NAIVE = """
import sys, torch
from safetensors.torch import load_file, save_file
states = [load_file(p + "/model.safetensors") for p in sys.argv[2:]]
out = {k: (sum(s[k].float() for s in states) / len(states)).to(torch.bfloat16) for k in states[0]}
save_file(out, sys.argv[1] + "/model.safetensors", metadata={"format": "pt"})
"""


TIMED = """
import json, sys
from pmakit._env import start_quickly
cli = start_quickly("pmakit.cli").cli  # as the `pmakit` command starts
from pmakit.merge import stream
with stream.timed() as stats:
    cli.main(sys.argv[2:], prog_name="pmakit", standalone_mode=False)
open(sys.argv[1], "w").write(json.dumps(stats.as_dict()))
"""
"""`pmakit merge` in process with the engine's timers on (``pmakit.merge.stream.timed``), the breakdown as JSON."""


FULL = {"layers": 15}
"""--full: the issue's ~1B-class layout, 8 x 1.61 GB (0.80B parameters each)."""


def install_mergekit(venv: Path) -> Path:
    """mergekit 0.1.5 in its own venv; torch pinned in the same pip call so that no other torch is resolved."""
    exe = venv / "bin" / "mergekit-yaml"
    if not exe.exists():
        print("installing mergekit 0.1.5 into its own venv (torch pinned to 2.13.0)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, "mergekit==0.1.5", "torch==2.13.0"], check=True)
    return exe


def floor_run(in_files: list[Path], out_dir: Path) -> None:
    subprocess.run(["cat", *map(str, in_files)], stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["cp", str(in_files[-1]), str(out_dir / "model.safetensors")], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="snapshots to merge")
    ap.add_argument("--full", action="store_true", help="the issue's size: 15 layers, 1.61 GB per snapshot")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (4: 0.61 GB per snapshot)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats (the median is reported)")
    ap.add_argument(
        "--data", type=Path, default=ROOT / "bench-data", help="snapshots, outputs, mergekit venv"
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=["naive", "mergekit", "cold", "warm", "timed"])
    ap.add_argument("--make-only", action="store_true", help="only generate the snapshots")
    ap.add_argument("--cuda", action="store_true", help="also `pmakit merge --device cuda` (needs a GPU)")
    ap.add_argument(
        "--workers",
        type=int,
        nargs="*",
        default=[],
        help="also `pmakit merge` with this many fold workers (PMAKIT_FOLD_WORKERS), as pmakit-<N>w",
    )
    ap.add_argument("--run-timeout", type=float, help="seconds before a run is killed and left out")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="also `pmakit merge` from this source tree (e.g. the main checkout's src)",
    )
    args = ap.parse_args()
    if args.full:
        vars(args).update(FULL)

    data = args.data
    data.mkdir(parents=True, exist_ok=True)
    print(f"making {args.n} snapshots under {data} (reused when present)", flush=True)
    snaps = make_snapshots(data, args)
    if args.make_only:
        return
    in_files = [s / "model.safetensors" for s in snaps]
    in_bytes = sum(f.stat().st_size for f in in_files)
    params = in_bytes // args.n // 2
    out_dir = data / "out"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT / "src")}

    mergekit = None if "mergekit" in args.skip else install_mergekit(data / "mergekit-venv")
    config = data / "mergekit.yml"
    config.write_text(
        "merge_method: linear\ndtype: float32\nout_dtype: bfloat16\nmodels:\n"
        + "".join(f"  - model: {s}\n    parameters:\n      weight: 1.0\n" for s in snaps)
    )
    methods: dict[str, list[str] | None] = {
        "floor": None,
        "pmakit": [sys.executable, "-m", "pmakit", "merge", *map(str, snaps), "-o", str(out_dir), "--quiet"],
        "timed": [
            sys.executable,
            "-c",
            TIMED,
            str(data / "timed.json"),
            "merge",
            *map(str, snaps),
            "-o",
            str(out_dir),
            "--quiet",
        ],
        "pmakit-cuda": [
            *[sys.executable, "-m", "pmakit", "merge", *map(str, snaps), "-o", str(out_dir), "--quiet"],
            *["--device", "cuda"],
        ],
        "naive": [sys.executable, "-c", NAIVE, str(out_dir), *map(str, snaps)],
        "mergekit": [str(mergekit), str(config), str(out_dir), "--no-lazy-unpickle", "--allow-crimes"],
    }
    for skipped in [*args.skip, *([] if args.cuda else ["pmakit-cuda"])]:
        methods.pop(skipped, None)
    envs = {name: env for name in methods}
    for n in args.workers:
        methods[f"pmakit-{n}w"] = [
            sys.executable,
            "-m",
            "pmakit",
            "merge",
            *map(str, snaps),
            "-o",
            str(out_dir),
            "-q",
        ]
        envs[f"pmakit-{n}w"] = {**env, "PMAKIT_FOLD_WORKERS": str(n)}
    if args.baseline:
        methods["baseline"] = [
            sys.executable,
            "-m",
            "pmakit",
            "merge",
            *map(str, snaps),
            "-o",
            str(out_dir),
            "-q",
        ]
        envs["baseline"] = {**env, "PYTHONPATH": str(args.baseline.resolve())}
    modes = [m for m in ("warm", "cold") if m not in args.skip]
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], int] = {}
    breakdowns: dict[str, list[dict[str, float]]] = {}
    loads = [os.getloadavg()[0]]
    failed: set[str] = set()
    for rep in range(args.repeats):
        for mode in modes:
            for name, cmd in methods.items():
                if name in failed:
                    continue
                shutil.rmtree(out_dir, ignore_errors=True)
                if mode == "cold":
                    evict(in_files)
                else:
                    subprocess.run(["cat", *map(str, in_files)], stdout=subprocess.DEVNULL, check=True)
                cpu0 = children_cpu()
                if cmd is None:
                    out_dir.mkdir()
                    t0 = time.perf_counter()
                    floor_run(in_files, out_dir)
                    seconds, peak = time.perf_counter() - t0, 0
                else:
                    if name in ("naive", "mergekit"):  # pmakit refuses an existing output
                        out_dir.mkdir()
                    try:
                        seconds, peak = run(cmd, envs[name], args.run_timeout)
                    except RuntimeError as e:  # reported, left out of the table; the others go on
                        print(f"  FAILED {name}: {e}", flush=True)
                        failed.add(name)
                        continue
                if name == "timed":
                    breakdowns.setdefault(mode, []).append(
                        {"seconds": seconds, **json.loads((data / "timed.json").read_text())}
                    )
                key = (mode, name)
                times.setdefault(key, []).append(seconds)
                cpu.setdefault(key, []).append(children_cpu() - cpu0)
                peaks[key] = max(peaks.get(key, 0), peak)
                loads.append(os.getloadavg()[0])
                print(
                    f"  [{rep + 1}/{args.repeats}] {mode:4} {name:11} {seconds:7.2f} s  cpu {cpu[key][-1]:6.1f} s  "
                    f"anon {peak / 2**20:6.0f} MiB  load {loads[-1]:.1f}",
                    flush=True,
                )
    shutil.rmtree(out_dir, ignore_errors=True)
    shown = [m for m in methods if all((mode, m) in times for mode in modes)]
    report(args, in_bytes, params, modes, shown, times, cpu, peaks, loads)
    for mode, runs in breakdowns.items():
        report_breakdown(mode, runs, times)


def report(
    args: argparse.Namespace,
    in_bytes: int,
    params: int,
    modes: list[str],
    methods: list[str],
    times: dict[tuple[str, str], list[float]],
    cpu: dict[tuple[str, str], list[float]],
    peaks: dict[tuple[str, str], int],
    loads: list[float],
) -> None:
    print(
        f"\n{args.n} snapshots x {in_bytes / args.n / 1e9:.2f} GB bf16 ({params / 1e9:.2f}B params, {args.layers} "
        f"layers) -> {in_bytes / args.n / 1e9:.2f} GB; {args.repeats} interleaved repeats; {os.cpu_count()} cores "
        f"shared with other processes, load average {min(loads):.1f}-{max(loads):.1f} (median "
        f"{statistics.median(loads):.1f}) during the run"
    )
    head = (
        f"{'mode':5} {'method':11} {'median s':>9} {'range s':>13} {'x floor':>8} {'cpu s':>7} {'GB/s in':>8}"
    )
    print(head + f" {'cores':>6} {'anon MiB':>9} {'mergekit/this':>14}")
    for mode in modes:
        floor = statistics.median(times[(mode, "floor")]) if (mode, "floor") in times else float("nan")
        mk = statistics.median(times[(mode, "mergekit")]) if (mode, "mergekit") in times else float("nan")
        for name in methods:
            ts = times[(mode, name)]
            t = statistics.median(ts)
            print(
                f"{mode:5} {name:11} {t:9.2f} {min(ts):6.2f}-{max(ts):6.2f} {t / floor:8.2f} "
                f"{statistics.median(cpu[(mode, name)]):7.1f} {in_bytes / t / 1e9:8.2f} "
                f"{statistics.median(cpu[(mode, name)]) / t:6.2f} "
                f"{peaks[(mode, name)] / 2**20:9.0f} {f'{mk / t:.2f}x' if mk == mk else '-':>14}"
            )


def report_breakdown(
    mode: str, runs: list[dict[str, float]], times: dict[tuple[str, str], list[float]]
) -> None:
    """Where the time of the timed run with the median wall time went, thread by thread (the engine's timers)."""
    b = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    floor = statistics.median(times[(mode, "floor")]) if (mode, "floor") in times else float("nan")
    plain = statistics.median(times[(mode, "pmakit")]) if (mode, "pmakit") in times else float("nan")
    fold = b["accumulate"] + b["cast"]
    writer = b["write"] + b["close"]
    print(
        f"\n{mode}: where pmakit's time goes (engine timers on, median run {b['seconds']:.2f} s; pmakit without "
        f"timers {plain:.2f} s; floor {floor:.2f} s; streaming passes {b['wall']:.2f} s, the rest is start-up, "
        "planning, manifest)"
    )
    print(
        f"  calling thread: read {b['read']:.2f} s, waits for a fold {b['wait_fold']:.2f} s, waits for a free "
        f"output buffer (writer behind) {b['wait_buffer']:.2f} s"
    )
    print(
        f"  workers (summed): bf16->fp32 + accumulate {b['accumulate']:.2f} s, cast + NaN/Inf check "
        f"{b['cast']:.2f} s; their CPU {b['fold_cpu']:.2f} s of {fold:.2f} s wall (the rest: no free core or a "
        f"disk read); page faults {b['minor_faults']:.0f} minor, {b['major_faults']:.0f} major"
    )
    print(
        f"  writer thread: write {b['write']:.2f} s, tail + fsync {b['close']:.2f} s = {writer:.2f} s busy, "
        f"waits for a shard's checksum {b['wait_hash']:.2f} s, {b['wait_chunk']:.2f} s idle; its CPU "
        f"{b['writer_cpu']:.2f} s"
    )
    print(
        f"  hasher thread (beside the writer): sha256 {b['sha256']:.2f} s busy; its CPU {b['hasher_cpu']:.2f} s"
    )
    cpu = b["fold_cpu"] + b["writer_cpu"] + b["hasher_cpu"]
    print(
        f"  fold + writer + hasher CPU {cpu:.2f} s over {b['wall']:.2f} s of streaming = {cpu / b['wall']:.2f} of "
        f"{os.cpu_count()} cores; "
        f"beyond the floor: {b['seconds'] - floor:+.2f} s"
    )


if __name__ == "__main__":
    main()
