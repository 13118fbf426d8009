"""Merging from object storage vs the GET floor of the same bytes, measured in the same run: wall time (ratio),
peak memory, and where the remote merge's time goes.

    python benchmarks/bench_s3.py              # `make bench-s3`: 10 bf16 snapshots of 0.18 GB, merged at N=4 and 10
    python benchmarks/bench_s3.py --n 4 --layers 8 --hidden 2048 --intermediate 5632 --repeats 3

A real S3 API server (moto's server mode, the one the tests use) runs on localhost; the snapshots (bench_merge's
Llama-shaped bf16 layout) are written on disk and uploaded to it. For each N, in turn: ``GET floor`` (every byte of
the N newest snapshots' weights fetched from the server in 16 MiB ranges, 32 in flight, and dropped: what this
server can serve at all), then the real CLI: ``pmakit merge RUN -o OUT --last N`` (disk to disk),
``pmakit merge s3://.../RUN -o OUT --last N`` (ranged GETs in, disk out), and with ``--s3-out`` also into
``s3://`` (staged and uploaded, manifest last). Each row gives the median wall time over the repeats, its ratio to
the floor of the same repeats, and the peak resident memory of the pmakit process (ru_maxrss from wait4: it counts
the disk merge's mapped input pages, which are page cache; the remote merge's blocks are process memory). One more
remote merge runs with the engine's timers on, started as the timed ones are, and splits its whole wall time: the
start (interpreters), the import, the mirror (the client, listing, headers, small files), the streaming pass (the
reading thread waiting on GETs, on the fold, on buffers; the fold workers; the writer), the rest of the command and
the exit; and the GETs themselves (count, size, how many in flight on average). moto serves the objects
from one Python process over loopback, on the cores the merge uses: neither number is a cloud's bandwidth.

``--store-cpus 0`` runs the server on core 0 only and this process, the floor's client and the merges on the
others (``os.sched_setaffinity``): a store that does not take the merge's cores, as a remote one does not. The
floor is then what one core of moto serves, and the ratio says how close the merge comes to it when the two do not
compete for cores. ``make bench-s3`` runs both layouts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_merge import make_snapshots  # noqa: E402
from peak_rss import measured, peak_bytes  # noqa: E402
from s3server import MotoServer, upload_tree  # noqa: E402


def run_merge(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one ``pmakit merge`` subprocess. The RSS is taken by a small launcher
    (tests/peak_rss.py: this process holds torch and would count in its children's ``ru_maxrss``); the wall time
    includes the launcher's start, ~0.03 s."""
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryDirectory() as scratch:
        rss = Path(scratch) / "rss"
        start = time.perf_counter()
        proc = subprocess.run(
            measured([sys.executable, "-m", "pmakit", "merge", *args, "--quiet", "--force"], rss),
            env=full_env,
            stderr=subprocess.PIPE,
            text=True,
        )
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"merge {' '.join(args)} failed: {proc.stderr[-2000:]}")
        return wall, peak_bytes(rss)


def get_floor(server: MotoServer, bucket: str, prefix: str, steps: list[str]) -> float:
    """Seconds to GET every input byte from the server, 16 MiB ranges, 32 in flight, into memory and dropped: what
    this server can serve, the floor of any merge from it."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    c = boto3.client(
        "s3",
        endpoint_url=server.url,
        config=Config(max_pool_connections=32),
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    objects = c.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    ranges = [
        (o["Key"], a, min(o["Size"], a + 16 * 2**20))
        for o in objects
        if o["Key"].endswith(".safetensors") and o["Key"].split("/")[-2] in steps
        for a in range(0, o["Size"], 16 * 2**20)
    ]

    def get(r: tuple[str, int, int]) -> int:
        body = c.get_object(Bucket=bucket, Key=r[0], Range=f"bytes={r[1]}-{r[2] - 1}")["Body"].read()
        return len(body)

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        sum(pool.map(get, ranges))
    return time.perf_counter() - start


BREAKDOWN = r"""
import time
t0 = time.monotonic()
import json, sys, threading
from pmakit import _env
from pmakit.storage import mirror, registry  # the standard library and boto3: not torch
marks = {"started": t0, "client": 0.0, "mirror": 0.0, "listing": 0.0, "made": 0.0}
lock = threading.Lock()
def timing(key, fn):  # fn, its time added to marks[key] (from any thread)
    def call(*args):
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            with lock:
                marks[key] += time.monotonic() - start
    return call
make_s3 = timing("client", registry.SCHEMES["s3"])
def timed_client():
    made = make_s3()
    for name in ("check_bucket", "listing"):
        setattr(made, name, timing("listing", getattr(made, name)))
    return made
registry.SCHEMES["s3"] = timed_client
mirror._mirror = timing("made", mirror._mirror)
gets = {"seconds": 0.0, "count": 0, "bytes": 0}
read = mirror.RemoteFile.read
def timed_read(self, start, stop):
    t = time.monotonic()
    data = read(self, start, stop)
    with lock:
        gets["seconds"] += time.monotonic() - t
        gets["count"] += 1
        gets["bytes"] += len(data)
    return data
mirror.RemoteFile.read = timed_read
_env.prefetch_inputs(sys.argv[1:])  # as `python -m pmakit` starts: the mirror is made while torch imports
cli = _env.start_quickly("pmakit.cli").cli
marks["import"] = time.monotonic() - t0
from pmakit import storage
from pmakit.merge.stream import timed
localize = storage.localize
def timed_localize(url):
    start = time.monotonic()
    try:
        return localize(url)
    finally:
        marks["mirror"] += time.monotonic() - start
        marks["mirror_gets"] = gets["count"]
        marks["mirror_requests"] = registry.request_count()
        gets.update(seconds=0.0, count=0, bytes=0)  # from here on: the streaming pass's GETs
storage.localize = timed_localize
t1 = time.monotonic()
with timed() as stats:
    cli.main(sys.argv[1:], standalone_mode=False)
marks["command"] = time.monotonic() - t1
import resource
print(json.dumps({**marks, **stats.as_dict(), "get_seconds": gets["seconds"], "gets": gets["count"],
                  "get_bytes": gets["bytes"], "requests": registry.request_count(),
                  "peak_rss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "ended": time.monotonic()}), flush=True)
_env.leave(0)  # as `python -m pmakit` ends

"""


def breakdown(args: list[str], env: dict[str, str]) -> dict[str, float]:
    """One more remote merge, started as the timed ones are (through the peak-RSS launcher), with its whole wall
    time split: the start (the launcher's and the merge's interpreters, up to the first line of the script), the
    import (``pmakit.cli`` and torch, as ``python -m pmakit`` imports them), the wait for the mirror (made in a
    thread beside the import, as the CLI starts it: the S3 client made, then the bucket check, listing, headers and
    small files, each timed there; the wait is what of it the import did not cover), the streaming pass (``pmakit.merge.stream.timed``: the
    calling thread's wait for the GETs it reads, the fold, the writer), what is left of the command (selection,
    plan, manifest) and the exit (from the command's return to the launcher's: the pool's threads joined, the
    mirror removed: ``pmakit._env.leave``, as the CLI ends). The clocks are ``time.monotonic`` in both processes
    (one clock on Linux). The GETs' own time is summed over the pool's threads."""
    import json

    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    with tempfile.TemporaryDirectory() as scratch:
        rss = Path(scratch) / "rss"
        launched = time.monotonic()
        proc = subprocess.run(
            measured([sys.executable, "-c", BREAKDOWN, "merge", *args, "--quiet", "--force"], rss),
            env=full_env,
            capture_output=True,
            text=True,
        )
        finished = time.monotonic()
        if proc.returncode != 0:
            raise SystemExit(f"breakdown run failed: {proc.stderr[-2000:]}")
        b = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
        b.update(
            total=finished - launched,
            start=b["started"] - launched,
            exit=finished - b["ended"],
            peak_rss=peak_bytes(rss),
        )
    b["rest"] = b["command"] - b["mirror"] - b["wall"]
    return b


def print_breakdown(n: int, b: dict[str, float], floor: float) -> None:
    parts = (
        f"start {b['start']:.2f} + import {b['import']:.2f} + waiting on the mirror {b['mirror']:.2f} (made in "
        f"{b['made']:.2f} s beside the import: client {b['client']:.2f}, bucket check and listing "
        f"{b['listing']:.2f}, {int(b['mirror_gets'])} GETs of headers and small files "
        f"{b['made'] - b['client'] - b['listing']:.2f}) + streaming {b['wall']:.2f} ({b['wall'] / floor:.2f}x the floor) + "
        f"selection, plan, manifest {b['rest']:.2f} + exit {b['exit']:.2f}"
    )
    print(
        f"  N={n} where the remote merge's time goes (one more run, timers on): wall {b['total']:.2f} s "
        f"({b['total'] / floor:.2f}x the floor) = {parts}"
    )
    print(
        f"  streaming: reader thread waiting on GETs {b['read']:.2f} s, on the fold {b['wait_fold']:.2f} s, on "
        f"buffers {b['wait_buffer']:.2f} s; fold workers {b['accumulate'] + b['cast']:.2f} s ({b['fold_cpu']:.2f} "
        f"s CPU); writer {b['write'] + b['close']:.2f} s busy, sha256 beside it {b['sha256']:.2f} s"
    )
    mb = b["get_bytes"] / 1e6
    print(
        f"  requests: {int(b['requests'])} ({int(b['mirror_requests'])} by the mirror); weight GETs: "
        f"{int(b['gets'])} of {mb / max(1, b['gets']):.1f} MB, {b['get_seconds']:.1f} s summed over "
        f"threads = {b['get_seconds'] / max(b['wall'], 1e-9):.1f} in flight on average during streaming, "
        f"{mb / max(b['wall'], 1e-9):.0f} MB/s while streaming; peak RSS {b['peak_rss'] / 2**20:.0f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="4,10", help="snapshots merged, comma-separated (one run holds the most)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument(
        "--shards", type=int, default=1, help="safetensors files per snapshot (HF's sharded layout)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--s3-out", action="store_true", help="also s3 -> s3 (staged and uploaded)")
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "s3")
    ap.add_argument(
        "--store-cpus",
        default="",
        help="cores for the server alone, comma-separated (e.g. 0); the merges and the floor's client get the rest",
    )
    args = ap.parse_args()
    ns = sorted(int(x) for x in args.n.split(","))
    cores = os.sched_getaffinity(0)
    store_cpus = {int(x) for x in args.store_cpus.split(",") if x.strip()}
    client_cpus = cores - store_cpus
    if store_cpus and (not store_cpus <= cores or not client_cpus):
        raise SystemExit(
            f"--store-cpus {args.store_cpus}: needs some of the cores {sorted(cores)}, not all of them"
        )

    # bench_merge's Llama-shaped bf16 snapshots
    shape = argparse.Namespace(
        layers=args.layers,
        hidden=args.hidden,
        intermediate=args.intermediate,
        vocab=32000,
        heads=16,
        kv_heads=4,
        shards=args.shards,
    )
    snaps = make_snapshots(args.data, argparse.Namespace(n=max(ns), **vars(shape)))
    run = snaps[0].parent
    size = sum(f.stat().st_size for snap in snaps for f in snap.glob("*.safetensors")) / len(snaps)
    print(
        f"{max(ns)} bf16 snapshots of {size / 1e9:.3f} GB ({args.layers} layers, hidden {args.hidden}, "
        f"{args.shards} file(s) each) on moto; "
        f"{args.repeats} repeat(s); load average {os.getloadavg()[0]:.1f} at start on {os.cpu_count()} cores"
    )
    server = MotoServer(cpus=store_cpus or None)
    if store_cpus:  # the floor's client threads and the merges (children) inherit this
        os.sched_setaffinity(0, client_cpus)
        print(
            f"the server on core(s) {sorted(store_cpus)} only; this process and the merges on {sorted(client_cpus)}"
        )
    try:
        client = server.client()
        client.create_bucket(Bucket="bench")
        upload_tree(client, run, "bench", "run")
        env = {**server.env(), "PMAKIT_STAGING": str(args.data / "staging")}
        out = args.data / "out"
        print(f"{'N':>3} {'mode':<14} {'wall s (median)':>16} {'/ floor':>8} {'peak RSS':>10}")
        for n in ns:
            steps = [p.name for p in snaps[-n:]]
            last = ["--last", str(n)]
            modes = {
                "disk -> disk": [str(run), "-o", str(out), *last],
                "s3 -> disk": ["s3://bench/run", "-o", str(out), *last],
            }
            if args.s3_out:
                modes["s3 -> s3"] = ["s3://bench/run", "-o", "s3://bench/merged", *last]
            results: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
            floors = []
            for _ in range(args.repeats):  # interleaved: the floor and each mode under the same load
                floors.append(get_floor(server, "bench", "run/", steps))
                for mode, margs in modes.items():
                    results[mode].append(run_merge(margs, env))
                    shutil.rmtree(out, ignore_errors=True)
            floor = statistics.median(floors)
            print(f"{n:>3} {'GET floor':<14} {floor:>16.2f} {1.0:>8.2f} {'-':>10}")
            for mode, rows in results.items():
                wall = statistics.median(w for w, _ in rows)
                rss = max(r for _, r in rows)
                print(f"{n:>3} {mode:<14} {wall:>16.2f} {wall / floor:>8.2f} {rss / 2**20:>7.0f} MiB")
            print_breakdown(n, breakdown(modes["s3 -> disk"], env), floor)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        server.stop()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
