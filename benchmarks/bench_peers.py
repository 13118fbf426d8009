"""The peers side by side: each peer's merger vs `pmakit merge` on the peer's own format, same inputs, one run.

    python benchmarks/bench_peers.py           # `make bench-peers`: ~8 min on the 2-core machine at load ~9*
    python benchmarks/bench_peers.py --only megatron --repeats 1   # one peer

(*) the first run also writes the inputs with each framework's own save code (~5 min) and installs mergekit 0.1.5
into its own venv (~1 min, as `make bench` does); both are reused afterwards (./bench-data/peers, git-ignored).

Every pair merges the same N checkpoints with the same weights (SMA, fp32 accumulation), with the same number of
ranks, each method in its own process:

- megatron-wm: Megatron-LM's ``tools/checkpoint/weighted_merge.py`` (its weighted-merge pull request, CPU gloo
  ranks, fp32 accumulation; run with megatron-core 0.19.2's code first on PYTHONPATH), taken at run time from a
  Megatron-LM git mirror (``--megatron-lm``, default the ``fetch`` tool's mirror path): the file is written under
  ./bench-data, never into this repository; without the mirror the pair is skipped with a line saying so.
  Manual mode: ``--merge-inputs iter_N:1/N ...``. Inputs: torch_dist checkpoints of a GPTModel (megatron-core,
  local layer spec, fp32) written by megatron-core's own save code (``tests/layouts/megatron_run.py``):
  ``mc16-tpK``: ``model-train``, the model's sharded state only, by the pinned megatron-core 0.16.1 (common.pt),
  at TP=K over K ranks; ``mc16moe-epK``: ``moe-model-train``, the same with 4 SequentialMLP experts and a sigmoid
  router with its load-balancing ``expert_bias`` (megatron-core's MoE layer), TP=1 and expert parallelism EP=K over
  K ranks; ``lm19-tpK``: ``lm-train``, Megatron-LM 0.19.2's own ``save_checkpoint`` (model, optimizer,
  RNG, the common state inside the DCP files). Both methods run under ``torchrun --nproc-per-node K``.
- olmo-core-offline: OLMo-core's offline merge (``benchmarks/bench_olmo_merge.py``: whole fp32 state in memory,
  then one save) on checkpoints written by OLMo-core 3.0.0's own ``Checkpointer``.
- mergekit: ``mergekit-yaml`` linear (fp32 accumulation, bf16 out) on HF safetensors snapshots
  (``benchmarks/bench_merge.py``'s generator).

warm: inputs read into the page cache before each run (median over ``--repeats`` interleaved repeats). cold: inputs
evicted from the page cache (posix_fadvise DONTNEED on the input files only; ``echo 3 > /proc/sys/vm/drop_caches``
would drop every other process's cache on this shared machine), one run; its bytes read are the storage reads
(``read_bytes`` of /proc/PID/io, summed over the method's processes, mmap page-ins included). Peak memory: the
largest RssAnon of any one process of the method (a rank, or a helper process it starts; not the torchrun launcher),
sampled every 10 ms: the page cache is not counted. Each output is checked against the hand average (every input
tensor loaded by torch.distributed.checkpoint or safetensors, averaged in fp64 here). ratio = pmakit / peer (below
1: pmakit is faster or smaller). The figures move with the load of other processes; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_merge  # noqa: E402
import bench_olmo_merge  # noqa: E402

MCORE19 = ROOT / ".venv" / "mcore-0.19"
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
WM_COMMIT = "30e10fd6b1873449673ded3e53dd10697e641ae9"
"""The weighted-merge branch's latest commit in the mirror ("Fix weighted merge timing reduction for NCCL groups")."""
MEGATRON_RUN = ROOT / "tests" / "layouts" / "megatron_run.py"

# Runs a command, then writes the /proc/self/io counters of everything it reaped (children's I/O accrues to the
# parent when it is waited for), so that the bytes read count every process of the method.
IO_WRAP = """
import subprocess, sys
def io():
    return {k: int(v) for k, v in (l.split(": ") for l in open("/proc/self/io").read().splitlines())}
before = io()
rc = subprocess.call(sys.argv[2:])
after = io()
open(sys.argv[1], "w").write(str(after["read_bytes"] - before["read_bytes"]))
sys.exit(rc)
"""


@dataclass
class Case:
    """A peer and pmakit on the same inputs."""

    peer: str
    fmt: str
    inputs: list[Path]
    files: list[Path]
    commands: dict[str, list[str]]
    outputs: dict[str, Path]
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    ranks: int = 1


@dataclass
class Result:
    warm: list[float] = field(default_factory=list)
    cold: float = float("nan")
    peak: int = 0
    read: int = 0
    diff: float = float("nan")


def base_env(*path: Path) -> dict[str, str]:
    pythonpath = os.pathsep.join(map(str, (*path, ROOT / "src")))
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": pythonpath}


def run_measured(
    cmd: list[str], env: dict[str, str], io_file: Path, launcher: bool
) -> tuple[float, int, int]:
    """Wall seconds, the largest RssAnon of one process (the torchrun launcher left out), bytes read from storage."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", IO_WRAP, str(io_file), *cmd],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wrapper = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            kids = wrapper.children(recursive=True)
            skip = {c.pid for c in wrapper.children()} if launcher else set()
        except psutil.Error:
            kids, skip = [], set()
        for p in kids:
            if p.pid in skip:
                continue
            try:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                pass
        time.sleep(0.01)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(last_error(err))
    return seconds, peak, int(io_file.read_text())


def last_error(stderr: str) -> str:
    """The line that says why a command failed (an exception's message or an ``Error:`` line)."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip().strip("=")]
    for line in reversed(lines):
        text = re.sub(r"^\[rank\d+\]: ", "", line)
        if text.startswith("Error:") or ("Error: " in text and not text.startswith("File ")):
            return text[:400]
    exits = [
        x for x in lines if x.startswith(("exitcode", "rank ", "error_file", "traceback"))
    ]  # torchrun's summary
    if exits:
        return "; ".join(exits)[:400]
    return (lines[-1] if lines else "no output")[:400]


def launch(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]


def free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def megatron_tool(data: Path, mirror: Path) -> Path | None:
    """weighted_merge.py from the Megatron-LM mirror, written under ``data`` (None where the mirror lacks it)."""
    target = data / "megatron-lm" / "tools" / "checkpoint" / "weighted_merge.py"
    if target.exists():
        return target
    show = subprocess.run(
        ["git", "--git-dir", str(mirror), "show", f"{WM_COMMIT}:tools/checkpoint/weighted_merge.py"],
        capture_output=True,
        text=True,
    )
    if show.returncode != 0:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(show.stdout)
    return target


def megatron_inputs(save: Path, mode: str, ranks: int, n: int, size: str) -> list[Path]:
    """N checkpoints by megatron_run.py (``model-train`` with megatron-core 0.16.1, ``lm-train`` with 0.19.2)."""
    wanted = [save / f"iter_{i:07d}" for i in range(1, n + 1)]
    if all((p / "metadata.json").exists() for p in wanted):
        return wanted
    shutil.rmtree(save, ignore_errors=True)
    env = {**base_env(*([MCORE19] if mode == "lm-train" else [])), "MEGATRON_RUN_SIZE": size}
    env["OMP_NUM_THREADS"] = "1"
    print(f"  writing {save} ({mode}, {ranks} rank(s), {n} iterations)", flush=True)
    subprocess.run(
        [*launch(ranks), str(MEGATRON_RUN), mode, str(save), str(n)],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return wanted


MEGATRON_INPUTS = (
    ("model-train", "mc16", "tp", "Megatron core 0.16.1 model-only"),
    ("moe-model-train", "mc16moe", "ep", "Megatron core 0.16.1 model-only MoE"),
    ("lm-train", "lm19", "tp", "Megatron LM 0.19.2 save_checkpoint"),
)
"""(megatron_run.py's mode, the inputs' folder prefix, the parallelism ``--tp K`` sets, the row's label)."""


def megatron_cases(args: argparse.Namespace, data: Path) -> list[Case]:
    tool = megatron_tool(data, args.megatron_lm)
    if tool is None:
        print(f"  skipped megatron-wm: no weighted_merge.py at {WM_COMMIT[:10]} in {args.megatron_lm}")
    if not (MCORE19 / "megatron" / "core").is_dir():
        print(f"  skipped megatron: megatron-core 0.19 is not unpacked at {MCORE19} (make test does it)")
        return []
    cases = []
    for mode, tag, split, label in MEGATRON_INPUTS:
        for ranks in args.tp:
            name = f"{tag}-{split}{ranks}"
            inputs = megatron_inputs(data / name / "save", mode, ranks, args.n, args.megatron_size)
            out = data / name / "out"
            # model-only checkpoints carry no token counters
            tokens = ["--tokens-per-step", "64"] if mode != "lm-train" else []
            pmakit = [
                *launch(ranks),
                "-m",
                "pmakit",
                "merge",
                str(inputs[0].parent),
                "-o",
                str(out / "pmakit"),
            ]
            commands = {"pmakit": [*pmakit, "--last", str(args.n), *tokens, "-q"]}
            outputs = {"pmakit": out / "pmakit"}
            if tool is not None:
                spec = [f"{p}:{1 / args.n!r}" for p in inputs]
                commands["peer"] = [*launch(ranks), str(tool), "--merge-inputs", *spec, "--merge-output"]
                commands["peer"].append(str(out / "peer"))
                outputs["peer"] = out / "peer"
            files = [f for p in inputs for f in p.iterdir() if f.is_file()]
            env = {**base_env(MCORE19), "MASTER_PORT": free_port()}  # the tool's own default is 29500
            fmt = f"{label} {split.upper()}{ranks}"
            cases.append(
                Case("megatron-wm", fmt, inputs, files, commands, outputs, {"peer": env}, ranks=ranks)
            )
    return cases


def olmo_case(args: argparse.Namespace, data: Path) -> Case:
    sizes = argparse.Namespace(n=args.n, layers=args.olmo_layers, d_model=args.olmo_d_model, vocab=32000)
    save = data / "olmo-core" / "save"
    inputs = bench_olmo_merge.make_checkpoints(save, sizes)
    out = data / "olmo-core" / "out"
    pmakit = [
        sys.executable,
        "-m",
        "pmakit",
        "merge",
        str(save),
        "-o",
        str(out / "pmakit"),
        "--last",
        str(args.n),
    ]
    commands = {
        "pmakit": [*pmakit, "-q"],
        "peer": [sys.executable, "-c", bench_olmo_merge.OLMO_OFFLINE, str(out / "peer"), *map(str, inputs)],
    }
    files = [f for p in inputs for f in (p / "model_and_optim").iterdir()]
    dcps = [p / "model_and_optim" for p in inputs]
    return Case(
        "olmo-core-offline",
        "OLMo-core 3.0.0 Checkpointer",
        dcps,
        files,
        commands,
        dict(pmakit=out / "pmakit", peer=out / "peer"),
    )


def mergekit_case(args: argparse.Namespace, data: Path) -> Case | None:
    sizes = argparse.Namespace(
        n=args.n, layers=args.hf_layers, hidden=2048, intermediate=5632, vocab=32000, heads=16, kv_heads=4
    )
    snaps = bench_merge.make_snapshots(data / "hf", sizes)
    try:
        exe = bench_merge.install_mergekit(ROOT / "bench-data" / "mergekit-venv")  # `make bench`'s
    except subprocess.CalledProcessError as e:
        print(f"  skipped mergekit: its install failed ({e})")
        return None
    config = data / "hf" / "mergekit.yml"
    config.write_text(
        "merge_method: linear\ndtype: float32\nout_dtype: bfloat16\nmodels:\n"
        + "".join(f"  - model: {s}\n    parameters:\n      weight: 1.0\n" for s in snaps)
    )
    out = data / "hf" / "out"
    commands = {
        "pmakit": [
            sys.executable,
            "-m",
            "pmakit",
            "merge",
            *map(str, snaps),
            "-o",
            str(out / "pmakit"),
            "-q",
        ],
        "peer": [str(exe), str(config), str(out / "peer"), "--no-lazy-unpickle", "--allow-crimes"],
    }
    files = [s / "model.safetensors" for s in snaps]
    return Case(
        "mergekit",
        "HF safetensors bf16",
        snaps,
        files,
        commands,
        dict(pmakit=out / "pmakit", peer=out / "peer"),
    )


def dcp_tensors(path: Path, keys: list[str] | None = None, olmo: bool = False) -> dict[str, torch.Tensor]:
    """Every floating tensor of a DCP checkpoint (or these keys), loaded by torch.distributed.checkpoint (OLMo-core's
    ``load_state_dict`` for ``olmo``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    meta = reader.read_metadata().state_dict_metadata
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
        and m.properties.dtype.is_floating_point
        and (keys is None or k in keys)
    }
    if (
        olmo
    ):  # OLMo-core's writer pickles a storage index that torch 2.13's own reader cannot read: its reader
        from olmo_core.distributed.checkpoint import load_state_dict

        load_state_dict(str(path), state)
    else:
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def hf_tensors(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(f)
    return {k: v for k, v in state.items() if keys is None or k in keys}


def against_hand_average(case: Case, output: Path) -> float:
    """The largest |output - mean of the inputs| over the output's tensors (the mean taken here in fp64)."""
    olmo = case.peer == "olmo-core-offline"

    def read(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
        if case.peer == "mergekit":
            return hf_tensors(path, keys)
        return dcp_tensors(path, keys, olmo)

    if case.peer != "mergekit":
        output = next(output.rglob(".metadata")).parent
    got = read(output)
    acc: dict[str, torch.Tensor] = {}
    for p in case.inputs:
        for k, v in read(p, list(got)).items():
            acc[k] = acc.get(k, torch.zeros(v.shape, dtype=torch.float64)) + v.double()
    if acc.keys() != got.keys():
        raise RuntimeError(f"keys differ from the inputs': {sorted(acc.keys() ^ got.keys())[:5]}")
    return max(float((got[k].double() - acc[k] / len(case.inputs)).abs().max()) for k in got)


def run_one(case: Case, method: str, mode: str, results: dict[str, Result], io_file: Path) -> None:
    if method in case.refused:
        return
    out = case.outputs[method]
    shutil.rmtree(out, ignore_errors=True)
    if case.peer == "mergekit" and method == "peer":
        out.mkdir(parents=True)
    if mode == "cold":
        bench_merge.evict(case.files)
    else:
        subprocess.run(["cat", *map(str, case.files)], stdout=subprocess.DEVNULL, check=True)
    env = case.envs.get(method, base_env())
    try:
        seconds, peak, read = run_measured(case.commands[method], env, io_file, case.ranks > 1)
    except RuntimeError as e:
        case.refused[method] = str(e)
        print(f"  {case.fmt:44} {method:6} FAILED: {e}", flush=True)
        return
    r = results.setdefault(method, Result())
    r.peak = max(r.peak, peak)
    if mode == "cold":
        r.cold, r.read = seconds, read
    else:
        r.warm.append(seconds)
    print(
        f"  {case.fmt:44} {method:6} {mode} {seconds:7.2f} s  anon {peak / 2**20:6.0f} MiB  "
        f"read {read / 2**20:6.0f} MiB  load {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if a == a and b == b and b > 0 else "-"


def report(
    cases: list[Case], results: list[dict[str, Result]], loads: list[float], args: argparse.Namespace
) -> None:
    print(
        f"\n{args.n} checkpoints per pair, SMA; {os.cpu_count()} cores shared with other processes, load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the run; warm = median of {args.repeats}, cold = 1 run"
    )
    head = f"{'peer':17} {'format':44} {'ranks':>5} {'method':11} {'warm s':>7} {'cold s':>7} {'peak MiB':>9}"
    print(head + f" {'read MiB':>9} {'max |out-avg|':>13}  ratio pmakit/peer: warm cold peak")
    for case, res in zip(cases, results):
        for method in ("peer", "pmakit"):
            name = case.peer if method == "peer" else "pmakit"
            if method in case.refused:
                print(f"{case.peer:17} {case.fmt:44} {case.ranks:5} {name:11} MISS: {case.refused[method]}")
                continue
            r = res.get(method, Result())
            warm = statistics.median(r.warm) if r.warm else float("nan")
            line = f"{case.peer:17} {case.fmt:44} {case.ranks:5} {name:11} {warm:7.2f} {r.cold:7.2f} "
            line += f"{r.peak / 2**20:9.0f} {r.read / 2**20:9.0f} {r.diff:13.2e}"
            if method == "pmakit" and "peer" in res and "peer" not in case.refused:
                p = res["peer"]
                pw = statistics.median(p.warm) if p.warm else float("nan")
                line += f"  {fmt_ratio(warm, pw):>5} {fmt_ratio(r.cold, p.cold):>5} {fmt_ratio(r.peak, p.peak):>5}"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4, help="checkpoints per pair")
    ap.add_argument("--repeats", type=int, default=1, help="warm runs per method (interleaved; the median)")
    ap.add_argument("--only", nargs="*", default=["megatron", "olmo", "mergekit"], help="which peers")
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2], help="Megatron TP degrees (= ranks)")
    ap.add_argument("--megatron-size", default="4,512,8,32000", help="layers,hidden,heads,vocab")
    ap.add_argument("--olmo-layers", type=int, default=4)
    ap.add_argument("--olmo-d-model", type=int, default=512)
    ap.add_argument("--hf-layers", type=int, default=2)
    ap.add_argument("--megatron-lm", type=Path, default=MIRROR, help="Megatron-LM git directory (a mirror)")
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "peers")
    args = ap.parse_args()
    args.data.mkdir(parents=True, exist_ok=True)
    print(f"making the inputs under {args.data} (reused when present)", flush=True)
    cases: list[Case] = []
    if "megatron" in args.only:
        cases += megatron_cases(args, args.data)
    if "olmo" in args.only:
        cases.append(olmo_case(args, args.data))
    if "mergekit" in args.only:
        cases += [c for c in [mergekit_case(args, args.data)] if c is not None]
    results: list[dict[str, Result]] = [{} for _ in cases]
    loads = [os.getloadavg()[0]]
    io_file = args.data / "io.txt"
    for mode in ["warm"] * args.repeats + ["cold"]:
        for case, res in zip(cases, results):
            for method in case.commands:
                run_one(case, method, mode, res, io_file)
                loads.append(os.getloadavg()[0])
    for case, res in zip(cases, results):
        for method, r in res.items():
            if method not in case.refused:
                try:
                    r.diff = against_hand_average(case, case.outputs[method])
                except Exception as e:  # reported, the table still printed
                    print(f"  {case.fmt}: {method}'s output not checked: {type(e).__name__}: {e}")
    report(cases, results, loads, args)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
