"""Merging from object storage vs the same files on disk: wall time (ratio), peak memory and the requests sent.

    python benchmarks/bench_s3.py              # `make bench-s3`: 4 x 0.44 GB bf16 snapshots, 3 interleaved repeats
    python benchmarks/bench_s3.py --layers 8 --n 8 --repeats 1

A real S3 API server (moto's server mode, the one the tests use) runs on localhost; the snapshots (bench_merge's
Llama-shaped bf16 layout) are written on disk and uploaded to it. Each repeat runs, in turn, the real CLI:
``pmakit merge RUN -o OUT`` (disk to disk), ``pmakit merge s3://.../RUN -o OUT`` (ranged GETs in, disk out) and
``pmakit merge s3://... -o s3://...`` (also staged and uploaded, manifest last). The table gives the median wall
time and its ratio to the disk merge, and the peak resident memory of the pmakit process (ru_maxrss from wait4: it
counts the disk merge's mapped input pages, which are page cache; the remote merge's chunks are process memory).
``GET floor``: every input byte fetched from the server in 16 MiB ranges, 32 in flight, and dropped: what this
server can serve at all. The requests are counted once per mode at an HTTP proxy in front of the server (not in
the timed runs). moto serves the objects from one Python process over loopback, on the cores the merge uses: the
floor beside the merges separates what the server can serve from what pmakit adds; neither is a cloud's bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_merge import make_snapshots  # noqa: E402
from s3server import FaultProxy, MotoServer, upload_tree  # noqa: E402


def run_merge(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one ``pmakit merge`` subprocess."""
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pmakit", "merge", *args, "--quiet", "--force"],
        env=full_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read() if proc.stderr else ""
    if status != 0:
        raise SystemExit(f"merge {' '.join(args)} failed: {err[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def get_floor(server: MotoServer, bucket: str, prefix: str) -> float:
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
        if o["Key"].endswith(".safetensors")
        for a in range(0, o["Size"], 16 * 2**20)
    ]

    def get(r: tuple[str, int, int]) -> int:
        body = c.get_object(Bucket=bucket, Key=r[0], Range=f"bytes={r[1]}-{r[2] - 1}")["Body"].read()
        return len(body)

    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        sum(pool.map(get, ranges))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="snapshots")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "s3")
    args = ap.parse_args()

    # bench_merge's Llama-shaped bf16 snapshots (hidden 2048, intermediate 5632, vocab 32000)
    shape = argparse.Namespace(
        layers=args.layers, hidden=2048, intermediate=5632, vocab=32000, heads=16, kv_heads=4
    )
    run = make_snapshots(args.data, argparse.Namespace(n=args.n, **vars(shape)))[0].parent
    size = sum(f.stat().st_size for f in run.rglob("*.safetensors"))
    server = MotoServer()
    try:
        client = server.client()
        client.create_bucket(Bucket="bench")
        upload_tree(client, run, "bench", "run")
        env = {**server.env(), "PMAKIT_STAGING": str(args.data / "staging")}
        out = args.data / "out"
        modes = {
            "disk -> disk": [str(run), "-o", str(out)],
            "s3 -> disk": ["s3://bench/run", "-o", str(out)],
            "s3 -> s3": ["s3://bench/run", "-o", "s3://bench/merged"],
        }
        results: dict[str, list[tuple[float, int]]] = {m: [] for m in modes}
        floors = []
        for _ in range(args.repeats):
            floors.append(get_floor(server, "bench", "run/"))
            for mode, margs in modes.items():
                results[mode].append(run_merge(margs, env))
                shutil.rmtree(out, ignore_errors=True)
        proxy = FaultProxy(server.port)
        requests = {}
        for mode, margs in modes.items():
            before = len(proxy.requests)
            run_merge(margs, {**env, "AWS_ENDPOINT_URL": proxy.url})
            requests[mode] = len(proxy.requests) - before
            shutil.rmtree(out, ignore_errors=True)
        proxy.stop()
    finally:
        server.stop()

    base = statistics.median(w for w, _ in results["disk -> disk"])
    print(
        f"{args.n} bf16 snapshots of {size / args.n / 1e9:.2f} GB ({args.layers} layers), {args.repeats} repeats; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'mode':<14} {'wall s (median)':>16} {'ratio':>6} {'peak RSS':>10} {'requests':>9}")
    floor = statistics.median(floors)
    print(f"{'GET floor':<14} {floor:>16.2f} {floor / base:>6.2f} {'-':>10} {'-':>9}")
    for mode, rows in results.items():
        wall = statistics.median(w for w, _ in rows)
        rss = max(r for _, r in rows)
        print(f"{mode:<14} {wall:>16.2f} {wall / base:>6.2f} {rss / 2**20:>7.0f} MiB {requests[mode]:>9}")


if __name__ == "__main__":
    main()
