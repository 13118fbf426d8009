"""Runs OLMo-core's own Trainer on CPU (gloo) for the layout tests: ``python olmo_core_run.py MODE ARGS`` or under
``torchrun --nproc-per-node 2`` (FSDP over 2 ranks).

``--experts E`` before the modes: OLMo-core's MoE transformer (``TransformerConfig.llama_like_moe``, E experts,
top-2, a shared expert, the router's ``score_bias`` for auxiliary-loss-free balancing) instead of the dense one.

Modes (several, separated by ``+``, run in one process one after the other):
  train-to WORK URL STEPS train's run saved to URL (s3://: OLMo-core's own remote writer; AWS_ENDPOINT_URL), WORK
                          local
  train SAVE STEPS        a tiny transformer, a checkpoint every step (CheckpointerCallback), ModelMergeCallback on
  reshard SRC DST K       the last K SRC/stepN loaded by OLMo-core's Checkpointer into this world size, saved to DST/stepN
  pma-init CKPT SAVE DUMP Trainer.load_checkpoint(CKPT), its loaded weights saved to DUMP, then one training step
  experts E               the jobs after this one use the MoE model of E experts (0: dense), as ``--experts``
  cli ARGS...             ``python -m pmakit ARGS`` (rank 0), e.g. the merge the next job loads
  score SNAPSHOT WORK OUT  a pmakit snapshot's weights in a fresh model, on the callback's lm-eval task (JSON to OUT)
  callback SAVE PMA STEPS [CRASH]  pmakit's OLMo-core PMACallback (snapshots into PMA every 2 steps' tokens, online
                          merge of 3 evaluated by an LM evaluator and on an lm-eval task every 2 steps,
                          checkpoints every 2 steps);
                          with CRASH, the process dies (os._exit) right after step CRASH

OLMo-core 3.0.0 trains, checkpoints and loads on CPU with gloo as it is, with two exceptions patched here: the MoE
forward's ``binned_gather``/``binned_scatter`` are triton kernels with no CPU driver (replaced by the same operation
in torch ops, ``binned_gather``/``binned_scatter`` below), and running several jobs in one process resets
OLMo-core's module-level FSDP world mesh between them (``build_world_mesh`` refuses a second one).
"""

# ruff: noqa: E402  (the collector is off before the framework's imports: see below)
from __future__ import annotations

import gc

# No cyclic garbage collection in a framework process of the tests: see run_framework in tests/layouts/conftest.py
gc.disable()

import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path
from typing import Any

import numpy as np
import olmo_core.distributed.parallel as olmo_parallel
import torch
from olmo_core.config import DType
from olmo_core.data import (
    NumpyDataLoaderConfig,
    NumpyFSLDatasetConfig,
    NumpyPaddedFSLDatasetConfig,
    TokenizerConfig,
)
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank, get_world_size
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import (
    Duration,
    TrainerConfig,
    prepare_training_environment,
    teardown_training_environment,
)
from olmo_core.train.callbacks import (
    Callback,
    CheckpointerCallback,
    LMEvaluatorCallbackConfig,
    ModelMergeCallback,
)
from olmo_core.train.checkpoint import CheckpointerConfig
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
from olmo_core.utils import seed_all

VOCAB = 64
SEQ = 16
BATCH = 4  # sequences per step
TOKENS_PER_STEP = BATCH * SEQ


def workdir(save: Path) -> Path:
    """Shared by the runs under one root (``ROOT/RUN/save``): token files and OLMo-core's dataset indices are made
    once (indexing the eval set costs seconds of process-pool start-up)."""
    return save.parent.parent / "work"


EXPERTS = 0
"""``--experts E`` before the first mode: an MoE transformer of E experts (0: the dense one)."""


def _slots(indices: torch.Tensor, bins: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each expert's kept assignments (its first ``capacity`` in ``indices``' sorted order): the flat
    ``token * top_k + k`` index and the output slot ``expert * capacity + j``, as OLMo-core's ``_binned_copy``."""
    indices, bins = indices.long(), bins.long()
    starts = torch.cat([bins.new_zeros(1), bins[:-1]])
    pos = torch.arange(indices.numel())
    expert = torch.bucketize(pos, bins, right=True)  # bins are the experts' cumulative (exclusive) ends
    j = pos - starts[expert]
    keep = j < capacity
    return indices[keep], expert[keep] * capacity + j[keep]


def binned_gather(
    x: torch.Tensor, indices: torch.Tensor, bins: torch.Tensor, bin_size: int, top_k: int
) -> torch.Tensor:
    """OLMo-core's ``ops.moe.binned_gather`` (a triton kernel, no CPU driver) in torch ops, autograd included."""
    flat, slot = _slots(indices, bins, bin_size)
    out = x.new_zeros(bins.numel() * bin_size, x.shape[1]).index_copy(0, slot, x[flat // top_k])
    return out.view(bins.numel(), bin_size, x.shape[1])


def binned_scatter(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor | None, bins: torch.Tensor, top_k: int
) -> torch.Tensor:
    """OLMo-core's ``ops.moe.binned_scatter`` in torch ops: each kept slot back to its token, scaled by its
    routing weight, summed over the token's top-k."""
    experts, capacity, hidden = x.shape
    flat, slot = _slots(indices, bins, capacity)
    rows = x.reshape(experts * capacity, hidden)[slot]
    if weights is not None:
        rows = rows * weights[flat].unsqueeze(1).to(rows.dtype)
    tokens = indices.numel() // top_k
    return x.new_zeros(tokens * top_k, hidden).index_copy(0, flat, rows).view(tokens, top_k, hidden).sum(1)


def model_config() -> TransformerConfig:
    if not EXPERTS:
        return TransformerConfig.llama_like(
            d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=2, hidden_size_multiple_of=16
        )
    # OLMo-core's MoE builder (MoEType.default: batched expert MLPs, no grouped-GEMM kernel needed on CPU), with
    # auxiliary-loss-free balancing (``bias_gamma``: the router's ``score_bias`` buffer) as well as its LB loss.
    config = TransformerConfig.llama_like_moe(
        d_model=32,
        vocab_size=VOCAB,
        n_layers=2,
        n_heads=2,
        num_experts=EXPERTS,
        top_k=2,
        expert_hidden_size=32,
        shared_expert_hidden_size=32,
        hidden_size_multiple_of=16,
    )
    assert config.block.feed_forward_moe is not None
    config.block.feed_forward_moe.router.bias_gamma = 1e-2
    return config


def train_module(work: Path) -> Any:
    model = model_config().build(init_device="cpu")
    ws = get_world_size()
    dp = None
    if ws > 1:
        dp = TransformerDataParallelConfig(
            name=DataParallelType.fsdp, param_dtype=DType.float32, reduce_dtype=DType.float32
        )
    config = TransformerTrainModuleConfig(
        rank_microbatch_size=TOKENS_PER_STEP // ws,
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        dp_config=dp,
    )
    return config.build(model, device=torch.device("cpu"))


TOKENIZER = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)


def token_file(work: Path, name: str, seed: int) -> Path:
    tokens = work / name
    if get_rank() == 0 and not tokens.exists():
        work.mkdir(parents=True, exist_ok=True)
        np.random.default_rng(seed).integers(1, VOCAB, 20_000, dtype=np.uint16).tofile(tokens)
    torch.distributed.barrier()
    return tokens


def data_loader(work: Path) -> Any:
    tokens = token_file(work, "tokens.npy", 0)
    tokenizer = TOKENIZER
    dataset = NumpyFSLDatasetConfig(
        paths=[str(tokens)], sequence_length=SEQ, tokenizer=tokenizer, work_dir=str(work)
    ).build()
    return NumpyDataLoaderConfig(global_batch_size=TOKENS_PER_STEP, seed=0, num_workers=0).build(dataset)


def trainer(save: Path | str, steps: int, callbacks: dict[str, Any], work: Path | None = None) -> Any:
    work = work or workdir(Path(save))
    config = TrainerConfig(
        save_folder=str(save),
        work_dir=str(work),
        max_duration=Duration.steps(steps),
        device="cpu",
        save_overwrite=True,
        metrics_collect_interval=1,
    )
    for name, cb in callbacks.items():
        config = config.with_callback(name, cb)
    return config.build(train_module(work), data_loader(work))


def train(save: Path | str, steps: int, work: Path | None = None) -> None:
    callbacks = {
        "checkpointer": CheckpointerCallback(
            save_interval=1, ephemeral_save_interval=None, save_async=False, max_checkpoints=None
        ),
        # OLMo-core's own online merge: writes stepN-merged/, which pmakit must ignore.
        "model_merger": ModelMergeCallback(enabled=True, merge_step=[3], merge_last_n_steps=2),
    }
    trainer(save, steps, callbacks, work).fit()


def reshard(src: Path, dst: Path, last: int) -> None:
    tm = train_module(workdir(dst))
    checkpointer = CheckpointerConfig(work_dir=str(workdir(dst)), save_overwrite=True).build()
    steps = sorted(int(p.name[4:]) for p in src.glob("step*") if p.name[4:].isdigit())
    for step in steps[-last:]:
        state = checkpointer.load(str(src / f"step{step}"), tm)
        assert state is not None
        checkpointer.save(str(dst / f"step{step}"), tm, state)


def pma_init(ckpt: str, save: Path, dump: Path) -> None:
    t = trainer(save, 10**6, {})
    t.load_checkpoint(ckpt)
    model = t.train_module.model
    if get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, dump)
    t.max_duration = Duration.steps(t.global_step + 1)
    t.fit()


class Crash(Callback):
    """Kills the process after step ``at``, as a node failure would (after the callbacks of that step)."""

    priority = -10

    def __init__(self, at: int) -> None:
        self.at = at

    def post_step(self) -> None:
        if self.step == self.at:
            os._exit(17)


CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "  # ids 1..63, 0 is EOS


def downstream_tasks(work: Path) -> Any:
    """The callback's lm-eval tasks: a 32-item multiple choice (lm-eval YAML, local data) read by a character
    tokenizer of the model's 64 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pmakit.eval.harness import LoopTasks
    from pmakit.eval.tasks import choice_task_yaml

    folder = work / "downstream"
    if get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        words = ["abc", "xyz", "klm", "QRS", "tuv", "DEF", "ghi", "nop"]
        items = [{"context": f"w{i} is ", "choices": [words[(i + j) % 8] for j in range(4)], "label": i % 4}
                 for i in range(32)]  # fmt: skip
        (folder / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
        (folder / "olmo_choice.yaml").write_text(choice_task_yaml("olmo_choice", folder / "data.jsonl"))
    torch.distributed.barrier()
    chars = Tokenizer(models.WordLevel({"~": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}, unk_token="~"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, eos_token="~")
    return LoopTasks(["olmo_choice"], tokenizer, limit=None, include=[folder])


class Spy(Callback):
    """After the callbacks of each step, the trainer's own ``eval_merged/`` metrics (what its loggers get) into
    ``PMA/trainer_metrics.jsonl``."""

    priority = -5

    def __init__(self, out: Path) -> None:
        self.out = out

    def post_step(self) -> None:
        found = {
            k: float(v)
            for k, v in self.trainer._metrics.get(self.step, {}).items()
            if k.startswith("eval_merged/")
        }
        if found and get_rank() == 0:
            with open(self.out, "a") as f:
                f.write(json.dumps({"step": self.step, **found}) + "\n")


def callback(save: Path, pma: Path, steps: int, crash: int | None) -> None:
    from pmakit.integrations.olmo_core import PMACallback

    work = workdir(save)
    evaluator = LMEvaluatorCallbackConfig(
        eval_dataset=NumpyPaddedFSLDatasetConfig(
            paths=[str(token_file(work, "eval.npy", 1))],
            metadata=[{"label": "val"}],
            sequence_length=SEQ,
            tokenizer=TOKENIZER,
            work_dir=str(work),
        ),
        eval_interval=2,
        eval_duration=Duration.steps(2),
    )
    callbacks: dict[str, Any] = {
        "checkpointer": CheckpointerCallback(save_interval=2, ephemeral_save_interval=None, save_async=False),
        "lm_evaluator": evaluator,
        "pma": PMACallback(
            save_dir=str(pma), every_tokens=2 * TOKENS_PER_STEP, last=3, downstream=downstream_tasks(work)
        ),
    }
    callbacks["spy"] = Spy(pma / "trainer_metrics.jsonl")
    if crash is not None:
        callbacks["crash"] = Crash(crash)
    trainer(save, steps, callbacks).fit()


def score(snapshot: Path, work: Path, out: Path) -> None:
    """``snapshot``'s weights (pmakit's, in OLMo-core's names) in a freshly built model, scored by the callback's
    lm-eval tasks outside any trainer: what the callback logged for a merge of that one snapshot."""
    from safetensors.torch import load_file

    from pmakit.integrations.olmo_core import CausalLMView

    model = model_config().build(init_device="cpu")
    model.load_state_dict(load_file(snapshot / "model.safetensors"))
    scores = downstream_tasks(work).scores(CausalLMView(model.eval(), SEQ))
    if get_rank() == 0:
        out.write_text(json.dumps(scores))


def run_job(mode: str, args: list[str]) -> None:
    global EXPERTS
    seed_all(0)  # each job starts from the same RNG state, as a fresh process would
    # OLMo-core builds its FSDP world mesh once per process; a job of its own gets a new one (the only patch).
    olmo_parallel._WORLD_MESH = None
    if mode == "train":
        train(Path(args[0]), int(args[1]))
    elif mode == "experts":  # the model of the jobs after this one (see --experts)
        EXPERTS = int(args[0])
    elif mode == "cli":  # pmakit's real CLI (rank 0), between the framework's jobs
        import subprocess

        if get_rank() == 0:
            # A merge of its own, not a rank of this job: under torchrun's variables pmakit would wait for the
            # other ranks to join its distributed merge.
            torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            env = {k: v for k, v in os.environ.items() if k not in torchrun}
            subprocess.run([sys.executable, "-m", "pmakit", *args], check=True, env=env)
        torch.distributed.barrier()
    elif mode == "reshard":
        reshard(Path(args[0]), Path(args[1]), int(args[2]))
    elif mode == "pma-init":  # the checkpoint may be a URL: kept a string (a Path folds s3:// into s3:/)
        pma_init(args[0], Path(args[1]), Path(args[2]))
    elif mode == "train-to":
        train(args[1], int(args[2]), Path(args[0]))
    elif mode == "score":  # a pmakit snapshot of the model in a fresh Transformer, on the callback's tasks
        score(Path(args[0]), Path(args[1]), Path(args[2]))
    elif mode == "callback":
        crash = int(args[3]) if len(args) > 3 else None
        callback(Path(args[0]), Path(args[1]), int(args[2]), crash)
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    """Jobs separated by ``+`` run one after the other in this process (one start-up for several runs)."""
    global EXPERTS
    argv = sys.argv[1:]
    if argv[:1] == ["--experts"]:
        EXPERTS, argv = int(argv[1]), argv[2:]
    from olmo_core.ops import moe as moe_ops

    moe_ops.binned_gather, moe_ops.binned_scatter = binned_gather, binned_scatter  # the MoE forward on CPU
    prepare_training_environment(seed=0, backend="cpu:gloo")
    try:
        while argv:
            job = argv[: argv.index("+")] if "+" in argv else argv
            argv = argv[len(job) + 1 :]
            run_job(job[0], job[1:])
    finally:
        teardown_training_environment()


if __name__ == "__main__":
    main()
