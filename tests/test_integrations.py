"""The HF Trainer and Lightning callbacks, each training a tiny Llama for a few dozen CPU steps."""

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pmakit.merge import merge
from pmakit.metrics import read_metrics
from pmakit.snapshot import discover
from pmakit.weights import get_weights


def test_core_resumes_the_window_from_disk(tmp_path: Path) -> None:
    """A restarted callback (no state but the snapshots) continues the same window at the resumed token count."""
    from pmakit.integrations import PMACore
    from pmakit.online import OnlineAverager

    model = torch.nn.Linear(4, 4)
    first = PMACore(tmp_path, 10, last=3, background=False)
    first.start(model, 0)
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.add_(1.0)
        first.step(model, tokens=10 * step, step=step)
    first.close()
    resumed = PMACore(tmp_path, 10, last=3)
    resumed.start(
        model, 40
    )  # the run resumes from a checkpoint at 40 tokens: the snapshot at 50 is not its past
    assert [t for t, _ in resumed.averager.window] == [20, 30, 40]
    reference = OnlineAverager(3, hold_in_memory=True)
    for s in discover(tmp_path)[:4]:
        reference.update(load_file(s.path / "model.safetensors"), tokens=s.tokens)
    for k, v in reference.average().items():
        torch.testing.assert_close(resumed.averager.average()[k], v)
    assert not resumed.saver.due(49) and resumed.saver.due(50)  # type: ignore[union-attr]
    records = read_metrics(tmp_path)
    assert [r["tokens"] for r in records if r["kind"] == "snapshot"] == [10, 20, 30, 40, 50]


def test_count_tokens_and_finding_the_hf_model() -> None:
    from pmakit.errors import PmakitError
    from pmakit.integrations import count_tokens, hf_model_in

    ids = torch.zeros(3, 7, dtype=torch.long)
    assert count_tokens({"input_ids": ids, "labels": ids}) == 21
    assert count_tokens((ids, ids)) == 21 and count_tokens(ids) == 21
    with pytest.raises(PmakitError, match="count_tokens"):
        count_tokens("text")
    wrapper = torch.nn.Module()
    wrapper.lm = tiny_llama()
    assert hf_model_in(wrapper) is wrapper.lm
    plain = torch.nn.Linear(2, 2)
    assert hf_model_in(plain) is plain


transformers = pytest.importorskip("transformers")

SEQ, BATCH, STEPS, EVERY, LAST = 16, 4, 24, 150, 3


def tiny_llama(seed: int = 0, tie: bool = True) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def sequences(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(seed))


def expected_tokens(per_step: list[int], every: int) -> list[int]:
    """Token counts at which a snapshot is due: each step whose count crosses a new multiple of ``every``."""
    out, tokens = [], 0
    for n in per_step:
        if (tokens + n) // every > tokens // every:
            out.append(tokens + n)
        tokens += n
    return out


@torch.no_grad()
def batch_loss(model: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    """Per-sample weighted mean loss, as the callbacks compute it."""
    model.eval()
    total = sum(float(model(**b).loss) * len(b["input_ids"]) for b in batches)
    return total / sum(len(b["input_ids"]) for b in batches)


def check_average_equals_merge(averager: Any, save_dir: Path, out: Path, method: str) -> Path:
    window = discover(save_dir)[-LAST:]
    assert [(s.tokens, s.path) for s in window] == averager.window
    merge(window, get_weights(method, LAST, alpha=0.2), out, dtype="fp32", fsync=False)
    merged = load_file(out / "model.safetensors")
    avg = averager.average()
    assert merged.keys() == avg.keys()
    for k, v in merged.items():
        torch.testing.assert_close(avg[k], v, rtol=0, atol=2e-6 * (1 + float(v.abs().max())))
    return out


@pytest.mark.parametrize("trainer_counts", [True, False])
def test_hf_trainer_callback(
    tmp_path: Path, trainer_counts: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from pmakit.integrations.hf import PMACallback

    ids = sequences(BATCH * STEPS, SEQ, seed=1)
    train = [{"input_ids": x, "labels": x} for x in ids]
    val_ids = sequences(8, SEQ, seed=2)
    evals = [{"input_ids": x, "labels": x} for x in val_ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=12,
        logging_steps=6,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,  # the Trainer's console line is then PrinterCallback's print of each log
        dataloader_num_workers=0,
        include_num_input_tokens_seen=trainer_counts,
        seed=0,
    )
    callback = PMACallback(tmp_path / "snaps", EVERY, last=LAST, method="ema")
    model = tiny_llama()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=[callback]
    )
    callback.attach(trainer)  # before the TensorBoard reporter, which the Trainer puts before user callbacks
    trainer.train()
    if trainer_counts:
        assert trainer.state.num_input_tokens_seen == STEPS * BATCH * SEQ
    else:
        assert callback.tokens == STEPS * BATCH * SEQ  # the forward hook counted training forwards only

    # Snapshots at the right token counts, loadable with from_pretrained, the newest equal to the final weights.
    snaps = discover(tmp_path / "snaps")
    assert [s.tokens for s in snaps] == expected_tokens([BATCH * SEQ] * STEPS, EVERY)
    assert snaps[-1].step == STEPS and snaps[0].lr is not None
    loaded = transformers.AutoModelForCausalLM.from_pretrained(snaps[-1].path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()

    # The online average is pmakit merge over the same snapshots; the merged eval is that model's eval loss.
    merged_dir = check_average_equals_merge(callback.averager, tmp_path / "snaps", tmp_path / "merged", "ema")
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    want = batch_loss(merged_model, [{"input_ids": val_ids, "labels": val_ids}])
    evals_logged = [r for r in read_metrics(tmp_path / "snaps") if r["kind"] == "eval"]
    merged_records = [r for r in evals_logged if r["model"] == "merged:ema:3"]
    assert [r["step"] for r in merged_records] == [12, 24]
    assert merged_records[-1]["tokens"] == STEPS * BATCH * SEQ
    assert merged_records[-1]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert [r["step"] for r in evals_logged if r["model"] == "latest"] == [12, 24]
    history = [h for h in trainer.state.log_history if "eval_merged_loss" in h]
    assert [h["step"] for h in history] == [12, 24]
    assert all("eval_loss" in h for h in history)  # on the evaluation's own entry, not a separate one
    # The merged loss reaches the Trainer's console line and TensorBoard with the eval loss it goes with.
    console = [line for line in capsys.readouterr().out.splitlines() if "'eval_merged_loss'" in line]
    assert len(console) == 2 and all("'eval_loss'" in line for line in console)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {f.parent for f in (tmp_path / "out").rglob("events.out.tfevents.*")}
    tb = EventAccumulator(str(events))
    tb.Reload()
    logged = [(e.step, e.value) for e in tb.Scalars("eval/merged_loss")]
    assert logged == [(h["step"], pytest.approx(h["eval_merged_loss"])) for h in history]
    metrics = trainer.evaluate()  # an evaluation after training is scored too, with the weights untouched
    assert metrics["eval_merged_loss"] == pytest.approx(want, rel=1e-5)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_lightning_callback(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from pmakit.integrations.lightning import PMACallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class LitLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama(tie=False)

        def training_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self.model(**batch).loss

        def validation_step(self, batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("val_loss", loss, batch_size=len(batch["input_ids"]))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    # Batches of varying size and length: the token count is what crosses multiples, not the steps.
    shapes = [(2 + i % 3, 8 + 4 * (i % 2)) for i in range(STEPS)]
    train = [{"input_ids": (x := sequences(b, s, seed=i)), "labels": x} for i, (b, s) in enumerate(shapes)]
    val = [{"input_ids": (x := sequences(b, SEQ, seed=100 + b)), "labels": x} for b in (3, 5)]
    loader = torch.utils.data.DataLoader(train, batch_size=None)
    val_loader = torch.utils.data.DataLoader(val, batch_size=None)
    callback = PMACallback(tmp_path / "snaps", 40, last=LAST, method="sma")
    module = LitLlama()
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=12,
        callbacks=[callback],
    )
    trainer.fit(module, loader, val_loader)
    per_step = [b * s for b, s in shapes]
    assert callback.tokens == sum(per_step)
    snaps = discover(tmp_path / "snaps")
    assert [s.tokens for s in snaps] == expected_tokens(per_step, 40)
    assert [s.step for s in snaps][-1] == STEPS
    loaded = transformers.AutoModelForCausalLM.from_pretrained(snaps[-1].path)
    for k, v in module.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    merged_dir = check_average_equals_merge(callback.averager, tmp_path / "snaps", tmp_path / "merged", "sma")
    want = batch_loss(transformers.AutoModelForCausalLM.from_pretrained(merged_dir), val)
    assert float(trainer.callback_metrics["val_merged_loss"]) == pytest.approx(want, rel=1e-5)
    records = [r for r in read_metrics(tmp_path / "snaps") if r["kind"] == "eval"]
    assert [(r["model"], r["step"]) for r in records] == [
        ("merged:sma:3", 12),
        ("latest", 12),
        ("merged:sma:3", 24),
        ("latest", 24),
    ]
    assert records[2]["val_loss"] == pytest.approx(want, rel=1e-5)
    assert records[3]["val_loss"] == pytest.approx(batch_loss(module.model, val), rel=1e-5)
