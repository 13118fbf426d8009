"""Writes and loads Megatron torch_dist checkpoints with megatron-core 0.16.1's own code on CPU (gloo), for the
layout tests: ``python megatron_run.py MODE ARGS`` (world size 1) or under ``torchrun --nproc-per-node 2``. Tensor
parallelism TP is the world size (TP=2 over 2 ranks) unless a job names it.

Modes (several, separated by ``+``, run in one process one after the other):
  train SAVE STEPS   a tiny GPTModel (local layer spec), torch Adam, a checkpoint SAVE/iter_000000N every step, as
                     Megatron-LM lays them out: ``dist_checkpointing.save`` of {model: model.sharded_state_dict(),
                     optimizer: the Adam state through megatron's ``optim_state_to_sharding_state`` (what its
                     FP32Optimizer saves), rng_state: a ShardedObject} + a common part (iteration, checkpoint_version,
                     args = an argparse.Namespace with consumed_train_samples, seq_length and a megatron enum, the
                     optimizer's param_groups), and ``latest_checkpointed_iteration.txt``
  model-train SAVE STEPS  as train, the model's sharded state only (no optimizer, RNG or common part)
  reshard SRC DST K  the last K SRC/iter_N loaded by ``dist_checkpointing.load`` (model and optimizer) into this
                     TP degree and saved again to DST/iter_N: the same weights, sharded TP ways
  pma-init CKPT DUMP [TP]  a model at TP (default: the world size; TP=1 on 2 ranks is 2 data-parallel replicas)
                     loaded from CKPT by ``dist_checkpointing.load`` with its default strictness, saved again to
                     DUMP (model only, megatron's writer), then one training step; prints one JSON line
                     {"tp": ..., "ep": ..., "loss": ..., "moved": ..., "version": megatron-core's}
  moe-train, moe-pma-init  the same with a MoE model (4 SequentialMLP experts, top-2 sigmoid router with
                     ``router.expert_bias``, moved every step by Megatron's own update) at TP=1 and expert
                     parallelism EP = the world size (or pma-init's last argument: EP=1 on 2 ranks is 2
                     data-parallel replicas)
  lm-train SAVE STEPS  (megatron-core 0.19's wheel, which ships Megatron-LM's ``megatron.training``) Megatron-LM's
                     own ``save_checkpoint`` every iteration: its args from its own parser, Megatron's FP32Optimizer
                     over the torch Adam, its OptimizerParamScheduler; its layout, common state and tracker file
  lm-load SAVE DUMP  Megatron-LM's own ``load_checkpoint`` of a save folder (``--no-load-optim``), the model saved
                     again to DUMP, one training step; prints {"tp": ..., "iteration": ..., "loss": ..., "moved": ...}
  cli ARGS...        ``python -m pmakit ARGS`` on rank 0 (outside the process group), the other ranks waiting

Patches (megatron-core assumes CUDA for these; nothing else is patched):
- ``torch.cuda.current_device`` returns "cpu": layers and the loss allocate on ``current_device()``.
- The CUDA RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()`` in attention):
  ``torch.cuda.get_rng_state`` / ``manual_seed`` and megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
  use the CPU generator, so the tracker's states are real CPU generator states.
- ``torch.cuda.synchronize`` is a no-op (the torch_dist writer calls it before writing).
- megatron-core 0.16.1's MoE router reads Transformer Engine's ``te_general_gemm`` unguarded: None without TE.
- Megatron-LM only: FP32Optimizer's loss scale is made on the CPU (its constructor puts it on "cuda"), and the
  tracker file is read without Megatron's max-over-ranks all-reduce (a "cuda" tensor).
The model gets an explicit causal mask (megatron's default one is built on "cuda"). psutil must be installed or
the torch_dist save hangs.
"""

from __future__ import annotations

import os
import sys
import typing

if not hasattr(
    typing, "override"
):  # megatron-core 0.19 imports Python 3.12's typing.override; run here on 3.11
    import typing_extensions

    typing.override = typing_extensions.override

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if __name__ == "__main__":
    # The torch_dist writer starts a helper process (multiprocessing "spawn") that re-imports this file: the
    # heavy imports happen in the real run only.
    # No cyclic garbage collection in a framework process of the tests: see run_framework in tests/layouts/conftest.py
    import gc

    gc.disable()
    import argparse
    import json
    import socket
    import subprocess
    from pathlib import Path
    from typing import Any

    import torch

VOCAB, SEQ, BATCH, LR = 64, 16, 4, 1e-2
LAYERS, HIDDEN, HEADS = 2, 32, 4
if os.environ.get("MEGATRON_RUN_SIZE"):  # benchmarks/bench_peers.py: "layers,hidden,heads,vocab"
    LAYERS, HIDDEN, HEADS, VOCAB = map(int, os.environ["MEGATRON_RUN_SIZE"].split(","))
EXPERTS = 0
"""MoE experts per layer (``moe-*`` modes: 4); 0 is the dense model."""


def init_distributed() -> None:
    """gloo over torchrun's environment, or a world of one on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")


def patch_cuda() -> None:
    """The CPU stand-ins listed in the module docstring."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 tests this Transformer Engine name without TE
        moe_utils.te_general_gemm = None
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment,return-value]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def build() -> tuple[Any, Any]:
    """The tiny GPTModel (same initial weights at any TP degree: CPU initialization splits one master weight)
    and a torch Adam over its parameters."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    moe = {}
    if (
        EXPERTS
    ):  # SequentialMLP experts over the expert-parallel group, a sigmoid router with a load-balancing bias
        moe = dict(
            num_moe_experts=EXPERTS,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_token_dispatcher_type="allgather",
            moe_ffn_hidden_size=16,
            add_bias_linear=False,  # 0.16.1's expert bias add is in place on a view at EP=1 (autograd refuses it)
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )
    config = TransformerConfig(
        **moe,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=tp_size(),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS or None, moe_grouped_gemm=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
    )
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def train_step(model: Any, optimizer: Any, step: int) -> float:
    generator = torch.Generator().manual_seed(step)  # the same batch on every rank
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).mean()
    loss.backward()
    if EXPERTS:
        update_expert_bias(model)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def update_expert_bias(model: Any) -> None:
    """Megatron's own aux-loss-free load balancing, as its ``finalize_model_grads`` ends every step: the router's
    ``expert_bias`` moves by ``moe_router_bias_update_rate`` towards the experts that got fewer tokens (counts
    all-reduced over the TPxDPxCP group), then the counts are reset. (The driver has no DDP wrapper, whose grad
    sync is the rest of ``finalize_model_grads``.)"""
    import importlib

    # The module, not the function of the same name that megatron.core.distributed exports.
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    finalize._update_router_expert_bias([model], model.config)
    finalize.reset_model_temporary_tensors(model.config, [model])


def sharded_state(model: Any, optimizer: Any, common: dict[str, Any]) -> dict[str, Any]:
    """What Megatron-LM's ``generate_state_dict`` hands to ``dist_checkpointing.save``: the model's and the
    optimizer's sharded state (the optimizer through megatron's own helpers, as its FP32Optimizer does), the RNG
    state as a ShardedObject, and the common (non-sharded) part."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_state = model.sharded_state_dict()
    optim_state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_state, params)
    optim_state_to_sharding_state(optim_state, id_map, exclude_keys=("step",))
    tp, tp_rank = tp_size(), parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()  # data-parallel copies (EP=2 at TP=1) are replicas
    rng = ShardedObject("rng_state", [torch.get_rng_state()], (1, tp), (0, tp_rank), replica_id=dp_rank)
    return {"model": model_state, "optimizer": optim_state, "rng_state": rng, **common}


def common_state(iteration: int) -> dict[str, Any]:
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        iteration=iteration,
        consumed_train_samples=iteration * BATCH,
        seq_length=SEQ,
        global_batch_size=BATCH,
        tensor_model_parallel_size=tp_size(),
        attention_backend=AttnBackend.auto,  # Megatron-LM's args hold megatron enums
    )
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration}


def save(state: dict[str, Any], directory: Path) -> None:
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(directory))


def train(save_dir: Path, steps: int) -> None:
    model, optimizer = build()
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
        save(sharded_state(model, optimizer, common_state(step)), save_dir / f"iter_{step:07d}")
        if torch.distributed.get_rank() == 0:
            (save_dir / "latest_checkpointed_iteration.txt").write_text(str(step))


def model_train(save_dir: Path, steps: int) -> None:
    """As ``train``, the model's sharded state only (no optimizer, RNG or common part): the layout that
    Megatron-LM's weighted merge tool accepts."""
    model, optimizer = build()
    for step in range(1, steps + 1):
        train_step(model, optimizer, step)
        save(model.sharded_state_dict(), save_dir / f"iter_{step:07d}")
        if torch.distributed.get_rank() == 0:
            (save_dir / "latest_checkpointed_iteration.txt").write_text(str(step))


def load(model: Any, optimizer: Any | None, checkpoint: Path) -> dict[str, Any]:
    """Megatron's own load, default strictness; the optimizer's moments too when given (Adam state made first,
    as megatron's ``init_state_fn`` does, so the sharded optimizer state has tensors to load into)."""
    from megatron.core import dist_checkpointing

    state: dict[str, Any] = {"model": model.sharded_state_dict()}
    if optimizer is not None:
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            optimizer.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            optimizer.state[p]["step"] = torch.tensor(0.0)
        state = sharded_state(model, optimizer, {})
        del state["rng_state"]
    loaded = dist_checkpointing.load(state, str(checkpoint))
    model.load_state_dict(loaded["model"])
    if optimizer is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, moments in loaded["optimizer"]["state"].items():
            for name, value in moments.items():
                optimizer.state[params[index]][name].copy_(value)
    return loaded


def reshard(src: Path, dst: Path, last: int) -> None:
    from megatron.core import dist_checkpointing

    iterations = sorted(int(p.name[5:]) for p in src.glob("iter_*"))[-last:]
    for iteration in iterations:
        model, optimizer = build()
        checkpoint = src / f"iter_{iteration:07d}"
        load(model, optimizer, checkpoint)
        common = dist_checkpointing.load_common_state_dict(str(checkpoint))
        keep = {k: v for k, v in common.items() if k in ("args", "checkpoint_version", "iteration")}
        save(sharded_state(model, optimizer, keep), dst / f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        (dst / "latest_checkpointed_iteration.txt").write_text(str(iterations[-1]))


def pma_init(checkpoint: Path, dump: Path) -> None:
    model, optimizer = build()
    load(model, None, checkpoint)
    save(model.sharded_state_dict(), dump)
    before = [p.detach().clone() for p in model.parameters()]
    loss = train_step(model, optimizer, 10**6)
    moved = all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if torch.distributed.get_rank() == 0:
        from megatron.core import package_info, parallel_state

        ep = parallel_state.get_expert_model_parallel_world_size()
        record = {
            "tp": tp_size(),
            "ep": ep,
            "loss": loss,
            "moved": moved,
            "version": package_info.__version__,
        }
        print(json.dumps(record))


def megatron_lm_args(save_dir: Path) -> Any:
    """Megatron-LM's global args (its own parser and defaults, as ``pretrain`` has them) for this model, set as
    the globals that ``save_checkpoint``/``load_checkpoint`` read."""
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.training import arguments, global_vars

    argv, sys.argv = sys.argv, ["pretrain_gpt.py"]
    sys.argv += [
        "--num-layers",
        str(LAYERS),
        "--hidden-size",
        str(HIDDEN),
        "--num-attention-heads",
        str(HEADS),
    ]
    sys.argv += ["--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--lr", str(LR)]
    sys.argv += ["--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH), "--train-iters", "100"]
    sys.argv += ["--save", str(save_dir), "--load", str(save_dir), "--ckpt-format", "torch_dist"]
    sys.argv += ["--tensor-model-parallel-size", str(tp_size())]
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = argv
    args.use_dist_ckpt = True  # what validate_args derives from --ckpt-format torch_dist
    args.consumed_train_samples = 0
    global_vars.set_args(args)
    dp = parallel_state.get_data_parallel_world_size()
    num_microbatches_calculator.unset_num_microbatches_calculator()
    num_microbatches_calculator.init_num_microbatches_calculator(
        torch.distributed.get_rank(), None, BATCH, BATCH // dp, dp
    )
    return args


def megatron_lm_optimizer(adam: Any) -> tuple[Any, Any]:
    """Megatron's FP32Optimizer over the torch Adam (its ``sharded_state_dict`` is what save_checkpoint stores)
    and Megatron-LM's OptimizerParamScheduler (constant lr). FP32Optimizer's loss scale is made on the CPU (its
    constructor puts it on "cuda")."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = FP32Optimizer.__new__(FP32Optimizer)
    MegatronOptimizer.__init__(optimizer, adam, OptimizerConfig(lr=LR), lambda opt, config=None: None)
    optimizer._scale, optimizer.is_stub_optimizer = torch.tensor([1.0]), False
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=LR,
        max_lr=LR,
        min_lr=LR,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def lm_train(save_dir: Path, steps: int) -> None:
    """Megatron-LM's own ``save_checkpoint`` every iteration (its iter_N layout, common state and
    latest_checkpointed_iteration.txt)."""
    from megatron.training.checkpointing import save_checkpoint

    args = megatron_lm_args(save_dir)
    model, adam = build()
    optimizer, scheduler = megatron_lm_optimizer(adam)
    for step in range(1, steps + 1):
        train_step(model, adam, step)
        scheduler.step(increment=BATCH)
        args.consumed_train_samples = step * BATCH
        save_checkpoint(step, [model], optimizer, scheduler, 0)


def lm_load(load_dir: Path, dump: Path) -> None:
    """Megatron-LM's own ``load_checkpoint`` of a save folder (``--load``, ``--no-load-optim``: the merge holds
    no optimizer state), the loaded model saved again to DUMP (model only), then one training step; prints one
    JSON line {"tp": ..., "iteration": ..., "loss": ..., "moved": ...}."""
    from megatron.training import checkpointing

    def read_tracker(tracker: str) -> tuple[int, bool]:  # Megatron's agrees on the max over ranks on "cuda"
        text = Path(tracker).read_text().strip()
        return (0, True) if text == "release" else (int(text), False)

    checkpointing.read_metadata = read_tracker
    args = megatron_lm_args(load_dir)
    args.no_load_optim = True
    model, adam = build()
    optimizer, scheduler = megatron_lm_optimizer(adam)
    iteration, _ = checkpointing.load_checkpoint([model], optimizer, scheduler)
    save(model.sharded_state_dict(), dump)
    before = [p.detach().clone() for p in model.parameters()]
    loss = train_step(model, adam, 10**6)
    moved = all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"tp": tp_size(), "iteration": iteration, "loss": loss, "moved": moved}))


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def use_tp(tp: int, ep: int = 1) -> None:
    """Megatron's model-parallel groups for tensor parallelism ``tp`` and expert parallelism ``ep`` (rebuilt when
    a job asks for others)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if (tp, ep) == (tp_size(), parallel_state.get_expert_model_parallel_world_size()):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def run_job(mode: str, args: list[str]) -> None:
    global EXPERTS
    world = torch.distributed.get_world_size()
    if mode == "cli":  # pmakit's real CLI (rank 0) between the framework's jobs: no second framework start-up
        if torch.distributed.get_rank() == 0:
            # A merge of its own, not a rank of this job: under torchrun's variables pmakit would wait for the
            # other ranks to join its distributed merge.
            torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            env = {k: v for k, v in os.environ.items() if k not in torchrun}
            subprocess.run([sys.executable, "-m", "pmakit", *args], check=True, env=env)
        torch.distributed.barrier()
        return
    if mode.startswith("moe-"):  # TP=1, EP = the world size unless a job names it
        EXPERTS, mode = 4, mode[4:]
        use_tp(1, int(args[2]) if mode == "pma-init" and len(args) > 2 else world)
    else:
        EXPERTS = 0
        use_tp(int(args[2]) if mode == "pma-init" and len(args) > 2 else world)
    if mode == "train":
        train(Path(args[0]), int(args[1]))
    elif mode == "model-train":
        model_train(Path(args[0]), int(args[1]))
    elif mode == "reshard":
        reshard(Path(args[0]), Path(args[1]), int(args[2]))
    elif mode == "pma-init":
        pma_init(Path(args[0]), Path(args[1]))
    elif mode == "lm-train":
        lm_train(Path(args[0]), int(args[1]))
    elif mode == "lm-load":
        lm_load(Path(args[0]), Path(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")


def main() -> None:
    """Jobs separated by ``+`` run one after the other in this process (one start-up for several runs)."""
    init_distributed()
    patch_cuda()
    from megatron.core import parallel_state

    argv = sys.argv[1:]
    try:
        while argv:
            job = argv[: argv.index("+")] if "+" in argv else argv
            argv = argv[len(job) + 1 :]
            run_job(job[0], job[1:])
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
