"""``pmakit train``: a small pre-training loop with a WSD schedule, snapshots every V tokens and an online merge.

One ``Trainer`` in sections: set-up (data, model, optimizer, saver, averager), the step, evaluation at snapshots,
full checkpoints for resuming, and hooks (``Callback``) that other parts of pmakit (spike recovery, the experiment)
use without touching the loop. Everything is counted in tokens.

Run directory:
    RUN/config.yaml          the config the run was started with
    RUN/tokenizer/           the tokenizer (copied into every snapshot, so each loads with from_pretrained)
    RUN/snapshots/step-N/    weights-only snapshots every ``every_tokens``
    RUN/checkpoint/          the latest full state (weights + optimizer + trainer state), for resuming
    RUN/checkpoints/tokens-T/ full states kept at the tokens in ``keep_checkpoints_at`` (fork points)
    RUN/metrics.jsonl        train / eval / snapshot / event records
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch

from pmakit.config import (
    AT_LEAST_1,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    OneOf,
    Range,
    Tokens,
    check_fields,
    from_mapping,
)
from pmakit.errors import PmakitError, first_line
from pmakit.evaluate import EvalResult, batch_loss, can_compile, evaluate
from pmakit.metrics import MetricsLog
from pmakit.online import OnlineAverager
from pmakit.runs import (
    checkpoint_dir,
    kept_checkpoint_dir,
    replace_dir,
    replica_dir,
    snapshots_dir,
    trainer_state,
)
from pmakit.saver import SnapshotSaver
from pmakit.schedule import DECAY_SHAPES, WSD
from pmakit.train.averaging import Averaging
from pmakit.train.callbacks import Callback, StopTraining
from pmakit.train.model import ModelConfig, active_parameters, balance_experts, build_model, count_parameters
from pmakit.train.replicas import SingleCopy
from pmakit.weights import WEIGHTINGS

log = logging.getLogger(__name__)

AUTO_COMPILE_STEPS = 1000
"""``compile: auto`` compiles the training step of a run with at least this many steps left: a compile costs ~15 s
(~4 s from inductor's cache), ~200 steps of what it saves at the demo's size, and a short run (a smoke study, a
test, an anneal branch of a few hundred steps) would spend more compiling than training."""


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a ``pmakit train`` run. Tokens are absolute counts (``4_000_000``); config files may use '4M'."""

    corpus: str | None = None
    """Text file, directory, glob or pre-tokenized .npy/.bin; None = the installed torch package's .py files (the same on every machine); "stdlib" = this Python's standard library."""
    max_corpus_bytes: Annotated[int | None, AT_LEAST_1] = 16_000_000
    """Read at most this many bytes of text (None: all)."""
    vocab_size: Annotated[int, AT_LEAST_1] = 2048
    """Byte-level BPE vocabulary trained on the corpus."""
    val_fraction: Annotated[float, FRACTION] = 0.05
    """Share of the corpus text (in whole files) held out for validation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model size."""
    batch_size: Annotated[int, AT_LEAST_1] = 16
    """Sequences per step (tokens per step = batch_size x model.seq_len)."""
    total_tokens: Annotated[Tokens, AT_LEAST_1] = 8_000_000
    """Train until this many tokens."""
    lr: Annotated[float, POSITIVE] = 3e-3
    """Peak (stable-phase) learning rate."""
    warmup_tokens: Annotated[Tokens, NON_NEGATIVE] = 400_000
    """Linear warmup length."""
    decay_tokens: Annotated[Tokens, NON_NEGATIVE] = 0
    """Length of the LR decay at the end of the run (0: constant LR to the end, the PMA setting)."""
    decay_shape: Annotated[str, OneOf(DECAY_SHAPES)] = "linear"
    """Decay shape: linear, cosine or 1sqrt."""
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.0
    """LR at the end of the decay, as a fraction of the peak."""
    optimizer: Annotated[str, OneOf(("adamw", "sgd"))] = "adamw"
    """``adamw``, or ``sgd`` (plain SGD, no momentum: the reference for model-copy tests)."""
    weight_decay: Annotated[float, NON_NEGATIVE] = 0.1
    """AdamW weight decay (not applied to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: Annotated[float, NON_NEGATIVE] = 1.0
    """Clip the gradient norm to this (0: no clipping)."""
    every_tokens: Annotated[Tokens, AT_LEAST_1] = 200_000
    """Snapshot interval V."""
    keep_last: Annotated[int | None, AT_LEAST_1] = None
    """Keep only the last K snapshots (None: all)."""
    average_last: Annotated[int, AT_LEAST_1] = 8
    """N of the online merge evaluated while training."""
    average_method: Annotated[str, OneOf(tuple(WEIGHTINGS))] = "sma"
    """Weighting of the online merge."""
    average_alpha: Annotated[float, Range(0, 1, lo_open=True)] = 0.2
    """EMA factor for ema weightings."""
    eval_every: Annotated[int, NON_NEGATIVE] = 1
    """Evaluate latest and merged weights every this many snapshots (0: never)."""
    eval_batches: Annotated[int, AT_LEAST_1] = 16
    """Held-out batches per evaluation (fixed for the whole run)."""
    checkpoint_every_tokens: Annotated[Tokens | None, AT_LEAST_1] = None
    """Write the full resume state this often (default: at every snapshot)."""
    keep_checkpoints_at: tuple[Tokens, ...] = ()
    """Token counts at which a full state is kept under RUN/checkpoints/ (fork points)."""
    log_every: Annotated[int, AT_LEAST_1] = 10
    """Log a train record every this many steps."""
    seed: int = 0
    """Seed of the initialisation and the data order."""
    threads: Annotated[int | None, AT_LEAST_1] = None
    """Torch intra-op threads (default: ``OMP_NUM_THREADS`` where set, else the cores available)."""
    router_aux_coef: Annotated[float, NON_NEGATIVE] = 0.0
    """MoE only: weight of HF's router load-balancing loss (``output_router_logits``; Switch-style, over every
    layer) added to the training loss. 0: none."""
    router_bias_rate: Annotated[float, NON_NEGATIVE] = 0.0
    """MoE only: auxiliary-loss-free balancing, the step u of ``bias += u * sign(mean load - load)`` after every
    optimizer step (``pmakit.train.model.balance_experts``). 0: the bias stays zero."""
    precision: Annotated[str, OneOf(("fp32", "bf16", "auto"))] = "fp32"
    """Training step's forward and backward: ``fp32``; ``bf16`` (autocast to bfloat16 on CPU or GPU; weights,
    optimizer state, snapshots and every evaluation stay fp32); ``auto``: bf16 where the hardware multiplies bf16
    natively (AVX512-BF16 or AMX CPUs, bf16 GPUs), else fp32. ``make bench-flops`` prints the step time both ways."""
    compile: Annotated[str, OneOf(("off", "on", "auto"))] = "off"
    """The training step's forward and loss through ``torch.compile`` (its backward with them): ``off``, ``on``, or
    ``auto`` (on where it can build kernels, a C++ compiler on CPU or triton on CUDA, for a run with at least
    ``AUTO_COMPILE_STEPS`` steps left). The demo's model: 0.77x the step time after a ~15 s compile (~4 s from
    inductor's on-disk cache). A compiler failure is one warning, then eager. Not bitwise reproducible on CPU (the
    compiled kernels' reductions): two runs of one config drift apart, so a resumed run is not the uninterrupted one
    bit for bit; the presets leave it off."""

    def __post_init__(self) -> None:
        check_fields(self, "train")  # the bounds declared on the fields above
        if self.every_tokens % self.tokens_per_step:
            raise PmakitError(
                f"every_tokens ({self.every_tokens}) must be a multiple of the tokens per step "
                f"({self.tokens_per_step} = batch_size x seq_len)"
            )
        if self.decay_tokens > self.total_tokens:
            raise PmakitError("decay_tokens is longer than the run")
        if (self.router_aux_coef or self.router_bias_rate) and not self.model.moe:
            raise PmakitError(
                "train.router_aux_coef and train.router_bias_rate need a MoE model (model.experts)"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise PmakitError(f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not 0 <= self.seed < 2**63:
            raise PmakitError(f"train.seed must be in 0 .. 2^63 - 1, got {self.seed}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def schedule(self) -> WSD:
        decay_start = self.total_tokens - self.decay_tokens if self.decay_tokens else math.inf
        return WSD(
            peak_lr=self.lr,
            warmup=self.warmup_tokens,
            decay_start=decay_start,
            decay_end=self.total_tokens if self.decay_tokens else math.inf,
            shape=self.decay_shape,
            floor=self.min_lr_ratio,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if (
            not self.model.moe
        ):  # a dense run's stamp reads as it did before MoE keys existed (resume compares it)
            for key in ("experts", "top_k", "expert_width"):
                out["model"].pop(key)
            for key in ("router_aux_coef", "router_bias_rate"):
                out.pop(key)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from a config file's ``train:`` mapping; unknown keys are an error naming them."""
        return from_mapping(cls, data, "train")


@dataclass
class _State:
    """What a resumed run needs beyond the weights and the optimizer."""

    step: int = 0
    tokens: int = 0
    lr_factor: float = 1.0
    lr_factor_until: int = 0
    recoveries: int = 0


class Trainer:
    """Trains one model; see the module docstring for what it writes."""

    def __init__(
        self,
        config: TrainConfig,
        run_dir: str | Path,
        *,
        corpus: Any = None,
        schedule: WSD | Callable[[float], float] | None = None,
        callbacks: Sequence[Callback] = (),
        init_from: str | Path | None = None,
        resume_from: str | Path | None = None,
        resume: bool = True,
        progress: bool = True,
        progress_note: Callable[[int], str] | None = None,
        copies: SingleCopy | None = None,
    ) -> None:
        """``progress``: a progress bar on a terminal, else a line on stderr every ``_Progress.every_s`` seconds
        (from the first interval on: a short run prints nothing); False: neither. ``progress_note``: called with
        the tokens trained so far by ``fit``, its text ends each progress line (a study's own progress)."""
        from pmakit._env import warn_if_spinning
        from pmakit.evaluate import cpu_threads, native_bf16

        self.config = config
        # The training step runs under bf16 autocast (``precision``: bf16, or auto on bf16-native hardware).
        self.bf16 = config.precision == "bf16" or (config.precision == "auto" and native_bf16())
        self.compiled = config.compile == "on"  # auto: decided once the run's starting point is known (below)
        self._compiled_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Model copies (``pmakit train --replicas``): rank 0 writes the run; the others only train and log.
        self.copies = copies or SingleCopy()
        for interval in (config.every_tokens, config.checkpoint_every_tokens, *config.keep_checkpoints_at):
            if interval:
                self.copies.check_interval(interval, config.tokens_per_step)
        self._copies_state: dict[str, Any] | None = None
        self.callbacks = list(callbacks)
        self.schedule = schedule or config.schedule()
        self.progress = progress
        self.progress_note = progress_note
        cpu_threads(config.threads)
        warn_if_spinning()

        self._setup_data(corpus)
        self._setup_model()
        self._setup_averaging()
        self._start_from(init_from=init_from, resume_from=resume_from, resume=resume)
        # tokens at the last step the copies agreed on (every step for one copy)
        self._synced_tokens = self.tokens
        # The step's forward + loss through torch.compile: ``compile: on``, or auto where kernels can be built and
        # the steps left to train repay the compile.
        steps_left = (config.total_tokens - self.tokens) // config.tokens_per_step
        if config.compile == "auto" and steps_left >= AUTO_COMPILE_STEPS and can_compile():
            self.compiled = True

    # ------------------------------------------------------------------ set-up steps

    def _setup_data(self, corpus: Any) -> None:
        """The corpus, the fixed held-out batches, and the tokenizer copied into the run."""
        from pmakit.train import data as data_mod

        config = self.config
        self.corpus = corpus or load_corpus(config)
        self.val = data_mod.val_batches(
            self.corpus.val,
            batch_size=config.batch_size,
            seq_len=config.model.seq_len,
            max_batches=config.eval_batches,
        )
        # bits per byte use the whole held-out text's bytes per token (the batches are a sample of it)
        self.bytes_per_token = self.corpus.bytes_per_token
        if self.copies.is_writer:
            self._install_tokenizer()

    def _setup_model(self) -> None:
        """The model (its config saved for the snapshots), the optimizer and a fresh trainer state."""
        config = self.config
        ids = self._special_ids()
        model: Any = build_model(config.model, self.corpus.vocab_size, seed=config.seed, **ids)
        if self.copies.is_writer:
            model.config.save_pretrained(self.run_dir / "model-config")
        self.model: torch.nn.Module = model
        self.optimizer = self._make_optimizer()
        self.state = _State()

    def _setup_averaging(self) -> None:
        """The metrics log, and snapshots + the online merge: the same hook as the framework adapters'."""
        config = self.config
        rank_dir = replica_dir(self.run_dir, self.copies.rank)
        self.metrics = MetricsLog(self.run_dir if self.copies.is_writer else rank_dir)
        self.averaging = Averaging(
            snapshots_dir(self.run_dir),
            config.every_tokens,
            last=config.average_last,
            method=config.average_method,
            alpha=config.average_alpha,
            eval_every=config.eval_every,
            keep_last=config.keep_last,
            metrics=self.metrics,
        )
        # The checkpoint brings the window. A copy that is not the writer keeps only the token marks: a restarted
        # one must not tidy the directory while the writer's save is in flight there.
        self.averaging.start(None, 0, self._extra_files(), rebuild=False, writer=self.copies.is_writer)
        self._last_snapshot: Any = None

    def _start_from(
        self, *, init_from: str | Path | None, resume_from: str | Path | None, resume: bool
    ) -> None:
        """Fork from ``resume_from``, resume this run's checkpoint, or initialise from ``init_from``."""
        checkpoint = checkpoint_dir(self.run_dir)
        if resume_from is not None:
            self.load_checkpoint(Path(resume_from), fork=True)
            if self.copies.is_writer:
                self._set_aside_later_states()
        elif resume and trainer_state(checkpoint).exists():
            self.load_checkpoint(checkpoint)
            log.info("resumed %s at %d tokens (step %d)", self.run_dir, self.tokens, self.step)
        elif init_from is not None:
            self._load_weights(Path(init_from))
            log.info("initialised from %s", init_from)
        # Records of steps after this one were written by an attempt killed before its next checkpoint (or before
        # its first): they are about to be written again. Time continues from the last record kept.
        self.metrics.resume_at(self.step, rollback_from=str(resume_from) if resume_from is not None else None)
        self.copies.attach(self.model)
        if self._copies_state is not None:
            self.copies.load_state_dict(self._copies_state, self.optimizer)

    def _set_aside_later_states(self) -> None:
        """A run continued from an earlier point (``--resume-from`` a ``pmakit recover`` output into the run it came
        from): the snapshots and the checkpoint past that point belong to the abandoned trajectory. They move to
        ``RUN/discarded/rollback-T/`` (where ``pmakit merge RUN`` never looks, as the spike callback's discards),
        before the first step, so that a merge of the run never averages two trajectories, even when this
        continuation stops part-way."""
        from pmakit.recover import DISCARDED_DIR
        from pmakit.snapshot import read_snapshot

        later = []
        for path in [*sorted(snapshots_dir(self.run_dir).glob("step-*")), checkpoint_dir(self.run_dir)]:
            try:
                if read_snapshot(path).tokens > self.tokens:
                    later.append(path)
            except (PmakitError, OSError):
                continue  # incomplete: the saver tidies it
        if not later:
            return
        target = Path(self.run_dir) / DISCARDED_DIR / f"rollback-{self.tokens}"
        target.mkdir(parents=True, exist_ok=True)
        for path in later:
            dest = target / path.name
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(path, dest)
        log.warning("moved %d snapshot(s) and checkpoint(s) past %s tokens, of the abandoned trajectory, to %s",
                    len(later), f"{self.tokens:,}", target)  # fmt: skip

    # ------------------------------------------------------------------ set-up helpers

    def _special_ids(self) -> dict[str, int | None]:
        tok_dir = getattr(self.corpus, "tokenizer_dir", None)
        if not tok_dir:
            return {}
        cfg = json.loads((Path(tok_dir) / "tokenizer.json").read_text())
        eos = next(
            (t["id"] for t in cfg.get("added_tokens", []) if t.get("content") == "<|endoftext|>"), None
        )
        return {"bos": eos, "eos": eos}

    def _install_tokenizer(self) -> None:
        src = getattr(self.corpus, "tokenizer_dir", None)
        if not src:
            return
        dst = self.run_dir / "tokenizer"
        if Path(src).resolve() != dst.resolve():
            shutil.copytree(src, dst, dirs_exist_ok=True)

    def _extra_files(self) -> list[Path]:
        """config.json, generation_config.json and the tokenizer: every snapshot loads on its own."""
        files = sorted((self.run_dir / "model-config").glob("*.json"))
        tok = self.run_dir / "tokenizer"
        if tok.is_dir():
            files += sorted(p for p in tok.iterdir() if p.is_file())
        return files

    def _make_optimizer(self) -> torch.optim.Optimizer:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for p in self.model.parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if self.config.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.config.lr, foreach=True)
        return torch.optim.AdamW(groups, lr=self.config.lr, betas=self.config.betas, foreach=True)

    # ------------------------------------------------------------------ properties

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def tokens(self) -> int:
        return self.state.tokens

    def lr_at(self, tokens: float) -> float:
        factor = self.state.lr_factor if tokens <= self.state.lr_factor_until else 1.0
        return self.schedule(tokens) * factor

    # ------------------------------------------------------------------ the loop

    def fit(self, until_tokens: int | None = None) -> Trainer:
        """Train until ``until_tokens`` (default: ``config.total_tokens``); Ctrl-C saves the state and re-raises."""
        cfg = self.config
        end = until_tokens or cfg.total_tokens
        self.model.train()
        # a fault-tolerant copy may be healed here: its step and tokens come from a live copy
        self.copies.join(self)
        self._synced_tokens = self.tokens
        for cb in self.callbacks:
            cb.on_train_start(self)
        bar = _Progress(
            self.tokens, end, enabled=self.progress, label=self.run_dir.name, note=self.progress_note
        )
        t0 = time.perf_counter()
        try:
            while self.tokens < end or not self.copies.in_sync(self.step):  # copies end on a sync
                record = self._train_step()
                loss_value = record["loss"]
                if self.step % cfg.log_every == 0 or not math.isfinite(loss_value):
                    record["tokens_per_s"] = round((self.tokens - bar.start) / (time.perf_counter() - t0))
                    self.metrics.write(record)
                bar.update(self.tokens, loss_value)
                for cb in self.callbacks:
                    cb.on_step_end(self, record)
                self._after_step(record)
        except StopTraining as e:
            self.metrics.write(
                {"kind": "event", "event": "stop", "tokens": self.tokens, "step": self.step, "reason": str(e)}
            )
            log.warning("training stopped: %s", e)
        except KeyboardInterrupt:
            self.saver.wait()
            if self.copies.size == 1:  # copies cannot gather their states once one of them is gone
                self.save_checkpoint(checkpoint_dir(self.run_dir))
            log.warning(
                "interrupted at %d tokens; the state is saved: run the same command to resume", self.tokens
            )
            raise
        finally:
            bar.close()
        self.saver.wait()
        self.save_checkpoint(checkpoint_dir(self.run_dir))
        for cb in self.callbacks:
            cb.on_train_end(self)
        return self

    def _step_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's loss for the step: through ``torch.compile`` when ``self.compiled`` (built on the first call);
        a compiler failure is one warning and the eager loss from then on (nothing was changed: no backward yet)."""
        if self.config.router_aux_coef:
            out = self.model(input_ids=x, output_router_logits=True)
            loss = torch.nn.functional.cross_entropy(
                out.logits.reshape(-1, out.logits.size(-1)).float(), y.reshape(-1)
            )
            return loss + self.config.router_aux_coef * out.aux_loss
        if not self.compiled:
            return batch_loss(self.model, x, y)
        if self._compiled_loss is None:
            model = self.model
            self._compiled_loss = torch.compile(lambda a, b: batch_loss(model, a, b), dynamic=False)
        try:
            return self._compiled_loss(x, y)
        except Exception as exc:
            log.warning("torch.compile failed (%s): training without it", first_line(exc))
            self.compiled = False
            return batch_loss(self.model, x, y)

    def _train_step(self) -> dict[str, Any]:
        """One optimizer step on this step's batch (every copy's share of it); its train record."""
        from pmakit.train.data import get_batch

        cfg = self.config
        x, y = get_batch(
            self.corpus.train,
            self.step,
            batch_size=cfg.batch_size,
            seq_len=cfg.model.seq_len,
            seed=cfg.seed,
            shard=self.copies.rank,
        )
        step_tokens = x.numel() * self.copies.size  # all copies' tokens
        lr = self.lr_at(self.tokens + step_tokens)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = self._step_loss(x, y)
        loss.backward()
        loss_value = loss.item()
        self.copies.reduce_gradients(self.model)
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.config.model.moe:
            balance_experts(self.model, self.config.router_bias_rate)
        self.state.step += 1
        self.state.tokens += step_tokens
        if self.copies.due(self.step):
            self._sync_copies()
        record: dict[str, Any] = {
            "kind": "train",
            "tokens": self.tokens,
            "step": self.step,
            "loss": loss_value,
            "grad_norm": grad_norm,
            "lr": lr,
        }
        if self.copies.size > 1:
            record["all_reduces"] = self.copies.all_reduces
        return record

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _sync_copies(self) -> None:
        """Bring the model copies together; first snapshot this copy's own weights when a snapshot is due."""
        cfg = self.config
        if self.copies.save_replicas and self.tokens // cfg.every_tokens > self.saver.last_mark:
            from pmakit.formats.safetensors_io import save_file
            from pmakit.snapshot import write_metadata

            directory = snapshots_dir(replica_dir(self.run_dir, self.copies.rank)) / f"step-{self.step}"
            directory.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                directory / "model.safetensors",
            )
            for f in self._extra_files():
                shutil.copy2(f, directory / f.name)
            write_metadata(directory, step=self.step, tokens=self.tokens, replica=self.copies.rank)
        self.copies.sync(self.model)

    def _after_step(self, record: dict[str, Any]) -> None:
        if not self.copies.in_sync(self.step):
            return  # copies between syncs are not the model: its snapshots and checkpoints wait for the next sync
        if self.copies.is_writer:
            snapshot = self.averaging.step(
                self.model, tokens=self.tokens, step=self.step, lr=record["lr"], loss=record["loss"]
            )
            if snapshot is not None:
                self._last_snapshot = snapshot
                for cb in self.callbacks:
                    cb.on_snapshot(self, snapshot)
                if self.averaging.snapshot_evaluation_due(self.tokens):
                    self.evaluate_now()
        self._checkpoint_if_due()
        self._synced_tokens = self.tokens

    def _checkpoint_if_due(self) -> None:
        """Checkpoint when a multiple of the interval (or a kept point) was crossed since the last time the
        copies were in sync (every step for one copy)."""
        cfg = self.config
        every_ckpt = cfg.checkpoint_every_tokens or cfg.every_tokens
        before = self._synced_tokens
        if before // every_ckpt < self.tokens // every_ckpt:
            self.save_checkpoint(checkpoint_dir(self.run_dir))
        for t in cfg.keep_checkpoints_at:
            if before < t <= self.tokens:
                self.save_checkpoint(kept_checkpoint_dir(self.run_dir, t))

    # ------------------------------------------------------------------ evaluation

    def evaluate_now(self) -> list[dict[str, Any]]:
        """Score the latest weights and the online merge on the fixed held-out batches, and log both."""
        base = {"kind": "eval", "tokens": self.tokens, "step": self.step}
        latest = evaluate(self.model, self.val, bytes_per_token=self.bytes_per_token)
        records = [{**base, "model": "latest", **latest.as_record()}]
        if self.averaging.merge_ready(min_count=2):
            with self.averaging.swapped_in(self.model):
                merged = evaluate(self.model, self.val, bytes_per_token=self.bytes_per_token)
            values = {**merged.as_record(), **_paired(merged, latest)}
            records.append(self.averaging.merged_record(self.tokens, self.step, values))
        for r in records:
            self.metrics.write(r)
        for cb in self.callbacks:
            cb.on_eval(self, records)
        return records

    def score(self, state: Mapping[str, torch.Tensor] | None = None) -> EvalResult:
        """Evaluate the current weights, or ``state`` swapped in for the duration."""
        if state is None:
            return evaluate(self.model, self.val, bytes_per_token=self.bytes_per_token)
        with swapped(self.model, state):
            return evaluate(self.model, self.val, bytes_per_token=self.bytes_per_token)

    # ------------------------------------------------------------------ snapshots, checkpoints, rollback

    @property
    def saver(self) -> SnapshotSaver:
        """The snapshot saver (owned by ``self.averaging``)."""
        return self.averaging.started_saver

    @property
    def averager(self) -> OnlineAverager:
        """The online merge (owned by ``self.averaging``)."""
        return self.averaging.averager

    def save_checkpoint(self, directory: Path) -> None:
        """The full state (weights, optimizer, trainer, saver, averager), written to a temp dir then renamed.

        With model copies every rank calls it (their optimizer states are gathered) and rank 0 writes.
        """
        copies = self.copies.gather_state(self.optimizer)
        if not self.copies.is_writer:
            return
        tmp = directory.parent / f".{directory.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        from pmakit.formats.safetensors_io import save_file

        save_file({k: v.detach() for k, v in self.model.state_dict().items()}, tmp / "model.safetensors")
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        config = self.config.to_dict()
        if config.get("corpus"):  # outside the run: absolute, so that the run resumes from any directory
            config["corpus"] = os.path.abspath(os.path.expanduser(config["corpus"]))
        # Plain values and tensors only, so that it loads with weights_only=True.
        state = {
            "trainer": asdict(self.state),
            **self.averaging.state_dict(),  # "saver", "averager" and how they record paths
            "config": config,
        }
        if copies is not None:
            state["copies"] = {**self.copies.state_dict(), "copies": copies}
        torch.save(_plain(state), trainer_state(tmp))
        for f in self._extra_files():
            shutil.copy2(f, tmp / f.name)
        from pmakit.snapshot import write_metadata

        write_metadata(tmp, step=self.step, tokens=self.tokens, lr=self.lr_at(self.tokens), kind="checkpoint")
        replace_dir(tmp, directory)

    def load_checkpoint(self, directory: Path, *, fork: bool = False) -> None:
        """Restore a full state, or continue from a snapshot with its step and tokens (a `pmakit recover` output).

        ``fork``: a new run branching off another run's state (it keeps the parent's snapshot grid but starts its
        own online merge). A snapshot without the trainer's state resumes at its ``pmakit.json`` step and tokens,
        with its ``optimizer.pt`` when it has one (``--optimizer keep-latest``), else a fresh optimizer.
        """
        from pmakit.snapshot import read_snapshot

        state_file = trainer_state(directory)
        if not state_file.exists():
            snap = read_snapshot(directory)
            if snap.step is None:
                raise PmakitError(
                    f"{directory}: its pmakit.json has no step, so training cannot continue from it"
                )
            self._load_weights(directory)
            if (directory / "optimizer.pt").exists():
                self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
            self.state = _State(step=snap.step, tokens=snap.tokens)
            self.saver.last_mark = snap.tokens // self.config.every_tokens
            log.info("continuing from %s at %d tokens (step %d)", directory, snap.tokens, snap.step)
            return
        self._load_weights(directory)
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", weights_only=True))
        saved = torch.load(state_file, weights_only=True)
        self.state = _State(**saved["trainer"])
        if "copies" in saved or self.copies.size > 1:
            self._copies_state = saved.get("copies", {})
        self.averaging.load_state_dict(saved, window=not fork)

    def _load_weights(self, directory: Path) -> None:
        from pmakit.formats import read_state

        state = read_state(directory)
        own = self.model.state_dict()
        wrong = [k for k, v in state.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            k = wrong[0]
            raise PmakitError(
                f"{directory}: weights of another model size than this config's ({len(wrong)} tensors differ, "
                f"e.g. {k} {list(state[k].shape)} vs {list(own[k].shape)}); give no config to take the model "
                "from the weights' config.json, or one whose model matches"
            )
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight" or not self.config.model.tie_embeddings]
        if missing or unexpected:
            raise PmakitError(
                f"{directory}: weights do not fit the model (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]})"
            )

    def rollback(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        optimizer: str | Mapping[str, Any] = "reset",
        reason: dict[str, Any] | None = None,
    ) -> None:
        """Replace the weights with ``state`` (e.g. a merge of pre-spike snapshots) and go on from here.

        Args:
            optimizer: ``reset`` (fresh AdamW moments), ``keep`` (the current moments) or an optimizer state dict
                to load (e.g. the one saved with the latest pre-spike checkpoint).
            reason: recorded in the event log.
        """
        with torch.no_grad():
            params = self.model.state_dict()
            for name, value in state.items():
                if name in params:
                    params[name].copy_(value)
        if optimizer == "reset":
            self.optimizer = self._make_optimizer()
        elif isinstance(optimizer, Mapping):
            self.optimizer.load_state_dict(dict(optimizer))
        elif optimizer != "keep":
            raise PmakitError(f"unknown optimizer policy {optimizer!r}; use reset, keep or a state dict")
        self.state.recoveries += 1
        self.metrics.write(
            {
                "kind": "event",
                "event": "rollback",
                "tokens": self.tokens,
                "step": self.step,
                "optimizer": optimizer if isinstance(optimizer, str) else "loaded",
                **(reason or {}),
            }
        )

    def set_lr_factor(self, factor: float, until_tokens: int) -> None:
        """Multiply the scheduled LR by ``factor`` until ``until_tokens`` (a cautious restart after a recovery)."""
        self.state.lr_factor = factor
        self.state.lr_factor_until = until_tokens

    def close(self) -> None:
        self.averaging.close()  # the saver and the metrics log
        self.copies.close()

    def describe(self) -> dict[str, Any]:
        m = self.config.model
        experts = (  # a dense model's description stays as it was
            {"active_parameters": active_parameters(self.model), "experts": m.experts, "top_k": m.top_k}
            if m.moe
            else {}
        )
        return {
            "parameters": count_parameters(self.model),
            **experts,
            "layers": self.config.model.layers,
            "hidden": self.config.model.hidden,
            "vocab_size": self.corpus.vocab_size,
            "seq_len": self.config.model.seq_len,
            "tokens_per_step": self.config.tokens_per_step,
            "precision": "bf16 autocast" if self.bf16 else "fp32",
            "compile": "training step through torch.compile" if self.compiled else "off",
        }


def _paired(a: EvalResult, b: EvalResult) -> dict[str, float]:
    from pmakit.evaluate import paired_difference

    delta, se = paired_difference(a, b)
    return {"delta_vs_latest": delta, "delta_se": se}


@contextmanager
def swapped(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Load ``state`` into ``model`` for the duration; the original weights come back even on error."""
    params = model.state_dict()
    saved = {k: params[k].detach().clone() for k in state if k in params}
    try:
        with torch.no_grad():
            for k in saved:
                params[k].copy_(state[k])
        yield
    finally:
        with torch.no_grad():
            for k, v in saved.items():
                params[k].copy_(v)


def _plain(x: Any) -> Any:
    """Paths to strings and tuples to lists, recursively (what ``torch.load(weights_only=True)`` accepts)."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return str(x) if isinstance(x, Path) else x


def saved_config(run_dir: str | Path) -> dict[str, Any] | None:
    """The train config stored in ``run_dir``'s checkpoint (None when it has none): what ``pmakit train -o RUN``
    continues with when no config is given."""
    state_file = trainer_state(checkpoint_dir(Path(run_dir)))
    if not state_file.is_file():
        return None
    try:
        config = torch.load(state_file, weights_only=True).get("config")
    except Exception as e:  # an unreadable state is the resume's business; say it here in one line
        raise PmakitError(f"{state_file}: unreadable ({type(e).__name__}: {e})") from None
    return dict(config) if isinstance(config, Mapping) else None


def source_config(weights: str | Path) -> tuple[dict[str, Any], str] | None:
    """The train config of the run ``weights`` came from, and where it was found: a full checkpoint's own; the
    saved config of the run holding the snapshot (or, for a merge, its newest input); else the demo preset with
    the model of the weights' ``config.json``. None when the weights carry no config at all."""
    directory = Path(weights)
    if trainer_state(directory).is_file():
        config = torch.load(trainer_state(directory), weights_only=True).get("config")
        if isinstance(config, Mapping):
            return dict(config), f"{directory}'s checkpoint"
    sources = [directory]
    manifest = directory / "pmakit-merge.json"
    if manifest.is_file():
        with_inputs = json.loads(manifest.read_text()).get("inputs") or []
        if with_inputs:
            sources.append(Path(with_inputs[-1]["path"]))
    for source in sources:
        for run in (source.parent, source.parent.parent):  # RUN/snapshots/step-N -> RUN
            config = saved_config(run)
            if config is not None:
                return config, f"the run {run}"
    hf = directory / "config.json"
    if not hf.is_file():
        return None
    from pmakit.config import load

    c = json.loads(hf.read_text())
    heads = c["num_attention_heads"]
    model = {
        "layers": c["num_hidden_layers"],
        "hidden": c["hidden_size"],
        "heads": heads,
        "kv_heads": None if c.get("num_key_value_heads", heads) == heads else c["num_key_value_heads"],
        "intermediate": c["intermediate_size"],
        "seq_len": c["max_position_embeddings"],
        "tie_embeddings": c.get("tie_word_embeddings", True),
    }
    train = dict(load(None, None, default_preset="demo").get("train", {}))
    train["model"] = model
    train["vocab_size"] = c["vocab_size"]
    return train, f"{hf} (the model; the rest: the demo preset)"


def load_corpus(config: TrainConfig) -> Any:
    """The tokenized corpus of ``config`` (built once, then read from the per-user cache)."""
    from pmakit.train.data import prepare_corpus

    return prepare_corpus(
        config.corpus,
        _cache_dir(),
        vocab_size=config.vocab_size,
        val_fraction=config.val_fraction,
        max_bytes=config.max_corpus_bytes,
        seed=config.seed,
    )


def _cache_dir() -> Path:
    """Tokenized corpora are cached per user, so that re-runs and other runs on the same text skip tokenizing."""
    root = os.environ.get("PMAKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pmakit"
    )
    return Path(root) / "corpus"


class _Progress:
    """Training progress: a tokens bar with ETA on a terminal (rich); elsewhere (a notebook, a log file, a pipe) a
    line on stderr every ``every_s`` seconds, the first one ``every_s`` in, so a short run stays quiet."""

    every_s = 30.0

    def __init__(
        self, start: int, end: int, *, enabled: bool, label: str, note: Callable[[int], str] | None = None
    ) -> None:
        import sys

        self.start = start
        self.end = end
        self.label = label
        self.enabled = enabled
        self.note = note
        self._t0 = self._last = time.monotonic()
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
                TextColumn("loss {task.fields[loss]:.3f}"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(stderr=True),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=end, completed=start, loss=float("nan"), note="")
            self._bar.start()

    def update(self, tokens: int, loss: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=tokens, loss=loss, note=self._note(tokens))
            return
        now = time.monotonic()
        if not self.enabled or now - self._last < self.every_s:
            return
        import sys

        note = self._note(tokens)

        self._last = now
        done = tokens - self.start
        rate = done / max(now - self._t0, 1e-9)
        eta = f", {(self.end - tokens) / rate:.0f} s left" if rate > 0 and tokens < self.end else ""
        print(
            f"{self.label}: {tokens:,}/{self.end:,} tokens ({100 * tokens / self.end:.0f}%), loss {loss:.3f}, "
            f"{rate:,.0f} tokens/s{eta}{'; ' + note if note else ''}",
            file=sys.stderr,
            flush=True,
        )

    def _note(self, tokens: int) -> str:
        """The caller's note for a line that is shown (not computed for the steps that show nothing)."""
        return self.note(tokens - self.start) if self.note is not None else ""

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def train(
    config: TrainConfig, run_dir: str | Path, *, callbacks: Sequence[Callback] = (), **kwargs: Any
) -> Trainer:
    """Train (or resume) a run; returns the finished ``Trainer``."""
    trainer = Trainer(config, run_dir, callbacks=callbacks, **kwargs)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer
