"""Merging OLMo-core checkpoints: pmakit vs OLMo-core's offline approach, on the same DCP checkpoints, in one run.

    python benchmarks/bench_olmo_merge.py   # `make bench-olmo` (part of `make bench`): N=4 x 106M params, ~3 min*
    python benchmarks/bench_olmo_merge.py --layers 2 --d-model 256 --vocab 4000 --n 3 --repeats 1   # a quick look

(*) including writing the checkpoints once (4 x 1.2 GB, reused afterwards), on the 2-core machine at load ~5.

Inputs: N checkpoints written by OLMo-core 3.0.0's own ``Checkpointer.save`` (``stepK/{model_and_optim/,
train/rank0.pt, .metadata.json}``) of a Llama-like OLMo-core ``Transformer`` in fp32 with AdamW state (one
optimizer step on random gradients, so ``optim.*`` holds moments as in a real run). Both methods write the SMA of
the model weights (fp32 accumulation) as an OLMo-core checkpoint that ``Checkpointer.load`` loads:

- pmakit: ``pmakit merge SAVE_FOLDER -o OUT --last N`` (streams tensor by tensor; writes the OLMo-core layout).
- olmo-core-offline: the approach of OLMo-core's ``merge_core_checkpoints.py`` script (``src/scripts`` of the
  OLMo-core repository; the 3.0.0 wheel ships no merge utility), with the installed OLMo-core API: for every
  checkpoint and key, ``load_state_dict`` into a tensor and ``add_`` it with weight 1/N into a whole-model fp32
  ``merged_state_dict``, then ``save_state_dict`` of it under ``model.``. Restricted here to the ``model.*`` keys
  (the script also averages the optimizer moments, which would only triple its work).

Each method runs in its own process; wall time (median over repeats, interleaved) and peak anonymous memory (RssAnon
sampled every 10 ms from /proc: the page cache is not counted) are measured in the same run, inputs warm in the
page cache. The two outputs are compared tensor by tensor. The figures move with the load of other processes on a
shared machine; the load average is printed with them. Data goes to ./bench-data/olmo-core (git-ignored).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import run  # noqa: E402  (wall seconds and peak RssAnon of a command)

# The OLMo-core offline approach, run as its own process: whole fp32 state in memory, then one save.
OLMO_OFFLINE = """
import sys, torch
from olmo_core.distributed.checkpoint import get_checkpoint_metadata, load_state_dict, save_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
out, inputs = sys.argv[1], [p + "/model_and_optim" for p in sys.argv[2:]]
merged = {}
for path in inputs:
    for key, meta in get_checkpoint_metadata(path).state_dict_metadata.items():
        if not key.startswith("model.") or not isinstance(meta, TensorStorageMetadata):
            continue
        if key not in merged:
            merged[key] = torch.zeros(meta.size)
        tensor = torch.empty_like(merged[key])
        load_state_dict(path, {key: tensor})
        merged[key].add_(tensor, alpha=1 / len(inputs))
save_state_dict(out + "/model_and_optim", merged, save_overwrite=True)
"""


def make_checkpoints(save: Path, args: argparse.Namespace) -> list[Path]:
    """N checkpoints written by OLMo-core's own Checkpointer (reused when present)."""
    wanted = [save / f"step{(i + 1) * 100}" for i in range(args.n)]
    if all((p / ".metadata.json").exists() for p in wanted):
        return wanted
    code = MAKE.format(save=str(save), n=args.n, d_model=args.d_model, layers=args.layers, vocab=args.vocab)
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
    )
    return wanted


MAKE = """
import torch
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import prepare_training_environment
from olmo_core.train.checkpoint import CheckpointerConfig
from olmo_core.train.train_module import TransformerTrainModuleConfig
prepare_training_environment(seed=0, backend="cpu:gloo")
model = TransformerConfig.llama_like(d_model={d_model}, vocab_size={vocab}, n_layers={layers}, n_heads=8).build(
    init_device="cpu")
tm = TransformerTrainModuleConfig(rank_microbatch_size=1024, max_sequence_length=1024,
    optim=AdamWConfig(lr=1e-3)).build(model, device=torch.device("cpu"))
checkpointer = CheckpointerConfig(work_dir="{save}/../work", save_overwrite=True).build()
for i in range(1, {n} + 1):
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    tm.optim.step()
    tm.optim.zero_grad()
    state = dict(global_step=i * 100, global_train_tokens_seen=i * 100 * 2**20, world_size=1)
    checkpointer.save("{save}/step%d" % (i * 100), tm, state)
    print("made step%d" % (i * 100), flush=True)
"""


def compare(a: Path, b: Path) -> float:
    """The largest difference between the two merged models' weights (read by pmakit's reader)."""
    from pmakit.layouts import open_weights

    worst = 0.0
    with open_weights(a) as ra, open_weights(b) as rb:
        if ra.tensors.keys() != rb.tensors.keys():
            raise SystemExit(
                f"the outputs hold different tensors: {sorted(ra.tensors.keys() ^ rb.tensors.keys())}"
            )
        for name, info in ra.tensors.items():
            x, y = ra.read(name, 0, info.numel).float(), rb.read(name, 0, info.numel).float()
            worst = max(worst, float((x - y).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=4, help="checkpoints to merge")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=ROOT / "bench-data" / "olmo-core")
    args = parser.parse_args()
    tag = f"L{args.layers}-D{args.d_model}-V{args.vocab}-N{args.n}"
    save = args.data / tag / "save"
    inputs = make_checkpoints(save, args)
    out = args.data / tag / "out"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    methods = {
        "pmakit": [
            sys.executable,
            "-m",
            "pmakit",
            "merge",
            str(save),
            "-o",
            str(out / "pmakit"),
            "--last",
            str(args.n),
            "--force",
            "-q",
        ],
        "olmo-core-offline": [sys.executable, "-c", OLMO_OFFLINE, str(out / "olmo"), *map(str, inputs)],
    }
    model_bytes = sum(f.stat().st_size for f in (inputs[0] / "model_and_optim").glob("*.distcp"))
    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, int] = dict.fromkeys(methods, 0)
    for r in range(args.repeats):
        for name, cmd in methods.items():
            for p in inputs:  # warm: read every input into the page cache first
                subprocess.run(
                    [
                        "cat",
                        *map(str, (p / "model_and_optim").glob("*")),
                    ],
                    stdout=subprocess.DEVNULL,
                )
            seconds, peak = run(cmd, env)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
            load = os.getloadavg()[0]
            print(
                f"  repeat {r + 1} {name:18s} {seconds:7.2f} s  anon {peak / 2**20:7.0f} MiB  load {load:.1f}"
            )
    diff = compare(out / "pmakit", out / "olmo")
    params = 0
    from pmakit.layouts import open_weights

    with open_weights(out / "pmakit") as reader:
        params = sum(i.numel for i in reader.tensors.values())
    print(
        f"\n{args.n} OLMo-core checkpoints of {params / 1e6:.0f}M params (model_and_optim {model_bytes / 2**30:.2f} "
        f"GiB each, fp32 model + AdamW), SMA; load average {os.getloadavg()[0]:.1f}; outputs differ by at most "
        f"{diff:.2e}"
    )
    print(f"{'method':20s} {'wall s (median)':>16s} {'range':>16s} {'peak anon MiB':>14s}")
    for name in methods:
        t = times[name]
        print(
            f"{name:20s} {statistics.median(t):16.2f} {f'{min(t):.2f}-{max(t):.2f}':>16s} {peaks[name] / 2**20:14.0f}"
        )
    a, b = statistics.median(times["olmo-core-offline"]), statistics.median(times["pmakit"])
    print(
        f"olmo-core-offline / pmakit: time {a / b:.2f}x, peak memory {peaks['olmo-core-offline'] / max(peaks['pmakit'], 1):.1f}x"
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s in all)")
