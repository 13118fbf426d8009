"""Runs torchtitan 0.3.0's own Trainer on CPU (gloo) for the layout tests: ``python torchtitan_run.py MODE ARGS``,
or under ``torchrun --nproc-per-node 2`` (FSDP over 2 ranks). Several modes separated by ``+`` run one after the
other in one process (torchtitan skips its process-group set-up once one exists).

Every job builds its config with torchtitan's own ``ConfigManager`` from the command line a user would type
(``--module llama3 --config llama3_debugmodel`` and the options below), then builds ``Trainer`` from it. Before the
first mode, ``--module deepseek_v3`` picks the deepseek_v3 debug model instead (3 of its 6 layers: see
``_smaller``; MoE: 8 routed experts as grouped ``[E, ...]`` tensors, 2 shared, top-3 routing, aux-loss-free
``expert_bias_E``), and ``--ep N`` sets
``--parallelism.expert_parallel_degree N`` (with ``--training.disable_cuda_graphs``, which torchtitan requires of
EP's all-to-all dispatcher; no CPU patch beyond those below was needed for EP over gloo).

Modes:
  train DUMP STEPS [OPT..]  the llama3 debug model, a checkpoint every step (DUMP/checkpoint/step-N, full state,
                            synchronous DCP), ``Trainer.train()``; OPT: more torchtitan options (e.g.
                            ``--checkpoint.export_dtype float16``, ``--checkpoint.last_save_in_hf``)
  reshard SRC DST N,M,..    SRC/checkpoint/step-N, step-M, ... (full checkpoints) loaded by torchtitan's CheckpointManager into this world
                            size (all but the data loader, which torchtitan cannot reshard) and saved again to
                            DST/checkpoint/step-N; ``ntokens_seen`` (per rank in torchtitan) divided by the data
                            parallel degree, as a run at this world size records it
  pma-init CKPT DUMP OUT    ``--checkpoint.initial_load_path CKPT --checkpoint.initial_load_model_only``: the
                            weights torchtitan loaded are saved to OUT (torch.save, rank 0), then one training step;
                            its step and loss go to OUT with suffix .json
  online DUMP PMA STEPS     ``pmakit.integrations.torchtitan.PMASnapshots`` in a Trainer subclass, a snapshot every 2
                            steps' tokens into PMA, checkpoints every step (full, so a rerun resumes from the last)
  cli ARGS...               ``python -m pmakit ARGS`` (rank 0), e.g. the merge the next job loads
  hf-init CKPT DUMP OUT     the same with ``--checkpoint.initial_load_in_hf`` (HF safetensors, torchtitan's
                            state-dict adapter)

Patches (CPU only; torchtitan 0.3.0 assumes an accelerator):
- ``torch._utils._get_available_device_type`` returns ``cpu`` while torchtitan is imported, so its
  ``tools.utils.device_type`` is ``cpu`` (else ``cuda``) and the process group is gloo;
- data: torchtitan's wheel ships neither its test tokenizer nor the ``c4_test`` set, so the tokenizer and the data
  loader are small stand-ins defined here (random tokens, a ``ParallelAwareDataloader`` like torchtitan's own, so the
  checkpoint's ``dataloader`` entry is the real one's);
- attention: torchtitan's llama3 uses FlexAttention (its only language-model backend besides CUDA varlen), which
  has no backward on CPU: ``FlexAttention.compiled_flex_attn`` is causal SDPA (each sequence is one document, so
  the block-causal mask is the causal one; gpt_oss's sliding windows of 128 cover the 32 positions), written out
  where the caller asks for the log-sum-exp (gpt_oss's attention sinks);
- model sizes: the qwen3 and gpt_oss MoE debug models' layer builders get 2 layers, 8 experts of width 64 (see
  ``_smaller``): the same code and names, megabytes instead of gigabytes;
- ``components.metrics.DeviceMemoryMonitor`` (accelerator memory statistics) is a stand-in reporting zeros;
- FSDP gradient reduction: ``distributed.fsdp.disable_fsdp_gradient_division`` also forces a SUM reduction (the
  same thing: torchtitan's divide factor is 1), as gloo has no ``PREMUL_SUM``;
- ``distributed.utils.set_pg_timeouts`` (after the first step) is skipped: its barrier passes
  ``device_ids=[torch.cpu.current_device()]``, the string ``"cpu"``, which gloo's barrier refuses;
- the 2-second sleep at the end of ``Trainer.train`` is skipped.
One option differs from the debug config: ``--parallelism.spmd_backend partial_dtensor`` (torchtitan's own choice
of FSDP over plain parameters; its default ``spmd_types`` refused to shard the model at world size 2 here).
The model (llama3 ``debugmodel``: SDPA attention, selective activation checkpointing), optimizer, LR schedule,
FSDP and the CheckpointManager are torchtitan's own, unpatched.
"""

# ruff: noqa: E402  (the collector is off before the framework's imports: see below)
from __future__ import annotations

import gc

# No cyclic garbage collection in a framework process of the tests: see run_framework in tests/layouts/conftest.py
gc.disable()

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._utils

_available = torch._utils._get_available_device_type
torch._utils._get_available_device_type = lambda: "cpu"  # the device patch (see the module docstring)
try:
    import torchtitan.components.metrics as tt_metrics
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.models.common.attention as tt_attention
    import torchtitan.trainer as tt_trainer
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import ConfigManager
    from torchtitan.tools import utils as tt_utils
finally:
    torch._utils._get_available_device_type = _available
assert tt_utils.device_type == "cpu"

from torch.utils.data import IterableDataset

MODELS = {
    "llama3": "llama3_debugmodel",
    "deepseek_v3": "deepseek_v3_debugmodel",
    "qwen3": "qwen3_moe_debug",  # MoE: 64 grouped experts, top-8, expert_bias_E; export_dtype="float16"
    "gpt_oss": "gpt_oss_debugmodel_flex",  # MoE with expert biases, attention sinks, router bias
}
MODULE = "llama3"  # ``--module M`` before the first mode picks another debug model (see MODELS)
EP = 1  # ``--ep N`` before the first mode: expert parallelism over N ranks (deepseek_v3)
VOCAB = 2048  # the debug models' vocabulary
SEQ = 32
BATCH = 4  # sequences per step, over all data-parallel ranks
TOKENS_PER_STEP = BATCH * SEQ


class _NoSleep(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


tt_trainer.time = _NoSleep("time")  # type: ignore[attr-defined]


class CPUMemoryMonitor:
    """In place of torchtitan's DeviceMemoryMonitor, which asks torch.cpu for accelerator memory statistics."""

    device_name = "cpu"
    device_capacity_gib = 0.0

    def __init__(self, *args: Any) -> None:
        pass

    def get_peak_stats(self) -> Any:
        return tt_metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


tt_metrics.DeviceMemoryMonitor = CPUMemoryMonitor  # type: ignore[misc]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, Any]:
    """In place of torchtitan's compiled FlexAttention, which has no backward on CPU: causal SDPA. Each sequence
    here is one document (positions 0..SEQ-1), so torchtitan's block-causal mask is exactly the causal one."""
    aux = kw.get("return_aux")
    if aux is None or not getattr(aux, "lse", False):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False)
        )
        return out, types.SimpleNamespace(lse=None)
    # gpt_oss's attention sinks need the log-sum-exp of the scores: causal attention written out.
    if kw.get("enable_gqa", False):
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) * (kw.get("scale") or q.shape[-1] ** -0.5)
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return scores.softmax(-1) @ v, types.SimpleNamespace(lse=scores.logsumexp(-1))


tt_attention.FlexAttention.compiled_flex_attn = staticmethod(causal_attention)  # type: ignore[method-assign]
_divide = tt_fsdp.disable_fsdp_gradient_division


def sum_gradients(model: torch.nn.Module) -> None:
    """torchtitan sets FSDP's gradient divide factor to 1, which FSDP reduces with ``PREMUL_SUM(1/1)``, an op gloo
    lacks; a plain SUM (``set_force_sum_reduction_for_comms``) is the same reduction."""
    _divide(model)
    for module in model.modules():
        if isinstance(module, torch.distributed.fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


tt_fsdp.disable_fsdp_gradient_division = sum_gradients
tt_dist_utils.set_pg_timeouts = lambda **kwargs: None  # its barrier passes device_ids=["cpu"] (see docstring)


def _smaller(build: Any, **sizes: int) -> Any:
    """torchtitan's layer-list builder with smaller sizes: the MoE debug models' expert sizes (64 experts of 768 for
    qwen3, 8 of 2880 for gpt_oss) make gigabyte checkpoints, too much for a CPU test; deepseek_v3's keeps its sizes
    (8 experts of 256) but 3 of its 6 layers (the dense one and two MoE), which halves its 380 MB checkpoints and the
    time of the suite's 8 training steps and 4 loads."""
    return lambda **kw: build(**{**kw, **sizes})


import torchtitan.models.deepseek_v3 as tt_deepseek_v3
import torchtitan.models.gpt_oss as tt_gpt_oss
import torchtitan.models.qwen3 as tt_qwen3

tt_deepseek_v3._build_dsv3_layers = _smaller(tt_deepseek_v3._build_dsv3_layers, n_layers=3)  # type: ignore[attr-defined]

tt_qwen3._build_qwen3_moe_layers = _smaller(  # type: ignore[attr-defined]
    tt_qwen3._build_qwen3_moe_layers, n_layers=2, num_experts=8, top_k=2, moe_hidden_dim=64
)
tt_gpt_oss._build_gptoss_layers = _smaller(  # type: ignore[attr-defined]
    tt_gpt_oss._build_gptoss_layers, n_layers=2, hidden_dim=64
)


class TinyTokenizer(BaseTokenizer):
    """A stand-in: the data below is token ids already."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        raise NotImplementedError

    def decode(self, *args: Any, **kwargs: Any) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return VOCAB


class RandomTokens(IterableDataset):  # type: ignore[type-arg]
    """Seeded random sequences, a different stream per data-parallel rank (as torchtitan splits its data)."""

    def __init__(self, dp_rank: int, seq_len: int) -> None:
        self.dp_rank, self.seq_len, self.seen = dp_rank, seq_len, 0

    def __iter__(self) -> Any:
        while True:
            g = torch.Generator().manual_seed(1000 * self.dp_rank + self.seen)
            x = torch.randint(1, VOCAB, (self.seq_len + 1,), generator=g)
            self.seen += 1
            yield {"input": x[:-1], "positions": torch.arange(self.seq_len)}, x[1:]

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


class RandomDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        pass

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            RandomTokens(dp_rank, seq_len),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def config(dump: Path, *options: str) -> Any:
    """torchtitan's config from the options a user would pass to its ``train.py``."""
    args = [
        *("--module", MODULE, "--config", MODELS[MODULE]),
        *("--dump_folder", str(dump), "--training.seq_len", str(SEQ)),
        *("--training.local_batch_size", str(BATCH // world_size()), "--training.steps", "10"),
        *("--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"),
        *("--metrics.log_freq", "1000", "--comm.init_timeout_seconds", "1800"),
        *("--parallelism.spmd_backend", "partial_dtensor"),  # see the module docstring
        *("--parallelism.expert_parallel_degree", str(EP)),
        # torchtitan refuses EP's all-to-all dispatcher under CUDA graphs, which are off on CPU anyway.
        *(("--training.disable_cuda_graphs",) if EP > 1 else ()),
        *options,
    ]
    cfg = ConfigManager().parse_args(args)
    cfg.tokenizer = TinyTokenizer.Config()
    cfg.dataloader = RandomDataLoader.Config()
    return cfg


def trainer(cfg: Any) -> Any:
    torch.manual_seed(0)
    return cfg.build()


def train(dump: Path, steps: int, *options: str) -> None:
    # The job config saved beside checkpoint/ names the model for the HF export; the last save is model-only, as
    # torchtitan's default (the debug config turns that off). ``options``: more of torchtitan's own options.
    cfg = config(
        dump,
        *("--training.steps", str(steps), "--debug.save_config_file", "config.json"),
        "--checkpoint.last_save_model_only",
        *options,
    )
    t = trainer(cfg)
    try:
        t.train()
    finally:
        t.close()


def reshard(src: Path, dst: Path, steps: list[int]) -> None:
    cfg = config(dst, "--checkpoint.exclude_from_loading", "dataloader")
    t = trainer(cfg)
    try:
        ckpt = t.checkpointer
        for step in steps:
            ckpt.folder = str(src / "checkpoint")
            ckpt.load(step=step)
            t.ntokens_seen //= t.dataloader.dp_world_size  # per rank (see the module docstring)
            ckpt.folder = str(dst / "checkpoint")
            ckpt.save(step)
            torch.distributed.barrier()
    finally:
        t.close()


def pma_init(ckpt: Path, dump: Path, out: Path, *hf: str) -> None:
    cfg = config(
        dump,
        *("--checkpoint.initial_load_path", str(ckpt), "--checkpoint.initial_load_model_only", *hf),
        *("--training.steps", "1", "--checkpoint.load_only"),
    )
    t = trainer(cfg)
    try:
        assert t.checkpointer.load(), "torchtitan loaded nothing"
        from torch.distributed.tensor import DTensor

        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in t.model_parts[0].state_dict().items()
        }
        if torch.distributed.get_rank() == 0:
            torch.save(state, out)
        losses: list[float] = []
        log = t.metrics_processor.log
        t.metrics_processor.log = lambda step, loss, *a, **k: (losses.append(loss), log(step, loss, *a, **k))
        t.config.metrics.log_freq = 1
        t.checkpointer.load = lambda step=-1: True  # already loaded above
        t.train()
    finally:
        t.close()
    if torch.distributed.get_rank() == 0:
        out.with_suffix(".json").write_text(
            json.dumps({"step": t.step, "loss": losses[-1] if losses else None})
        )


def online(dump: Path, pma: Path, steps: int) -> None:
    """pmakit's PMASnapshots in a Trainer subclass (the README's recipe); resumes from DUMP's checkpoints."""
    from pmakit.integrations.torchtitan import PMASnapshots

    class PMATrainer(tt_trainer.Trainer):
        def train_step(self, data_iterator: Any) -> None:
            super().train_step(data_iterator)
            self.pma.after_step(self)

    torch.manual_seed(0)
    t = PMATrainer(config=config(dump, "--training.steps", str(steps)))
    t.pma = PMASnapshots(pma, every_tokens=2 * TOKENS_PER_STEP)  # type: ignore[attr-defined]
    try:
        t.train()
    finally:
        t.pma.close()  # type: ignore[attr-defined]
        t.close()


def run_job(mode: str, args: list[str]) -> None:
    if mode == "train":
        train(Path(args[0]), int(args[1]), *args[2:])
    elif mode == "reshard":
        reshard(Path(args[0]), Path(args[1]), [int(x) for x in args[2].split(",")])
    elif mode == "pma-init":
        pma_init(Path(args[0]), Path(args[1]), Path(args[2]))
    elif mode == "hf-init":
        pma_init(Path(args[0]), Path(args[1]), Path(args[2]), "--checkpoint.initial_load_in_hf")
    elif mode == "online":
        online(Path(args[0]), Path(args[1]), int(args[2]))
    elif mode == "cli":  # pmakit's real CLI (rank 0), between the framework's jobs
        import subprocess

        if torch.distributed.get_rank() == 0:
            # A merge of its own, not a rank of this job: under torchrun's variables pmakit would wait for the
            # other ranks to join its distributed merge.
            torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            env = {k: v for k, v in os.environ.items() if k not in torchrun}
            subprocess.run([sys.executable, "-m", "pmakit", *args], check=True, env=env)
        torch.distributed.barrier()
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    global MODULE, EP
    argv = sys.argv[1:]
    while argv[:1] in (["--module"], ["--ep"]):
        if argv[0] == "--module":
            MODULE = argv[1]
        else:
            EP = int(argv[1])
        argv = argv[2:]
    if "RANK" not in os.environ:  # a plain python process: a group of one
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    torch.distributed.init_process_group("gloo")
    try:
        while argv:
            job = argv[: argv.index("+")] if "+" in argv else argv
            argv = argv[len(job) + 1 :]
            run_job(job[0], job[1:])
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
