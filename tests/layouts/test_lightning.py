"""Lightning's own checkpoints: the ``epoch=..-step=...ckpt`` files ``ModelCheckpoint`` writes (lightning's own
``Trainer.fit``, CPU). Found in a folder or named one by one, read with ``weights_only=True``, merged with no flags
but the tokens per step equal to the hand average, and the merged ``.ckpt`` resumed by ``Trainer.fit``, which
trains a step on it; ``Model.load_from_checkpoint`` loads it."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from pmakit.cli import cli

pl = pytest.importorskip("lightning.pytorch")

STEPS, EVERY, BATCH = 12, 4, 6
TOKENS_PER_BATCH = 10  # what the PMACallback run counts per batch


class Tiny(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Two linear layers, an integer buffer (a counter: copied from the newest, never averaged), hyper-parameters
    and an lr schedule, as a LightningModule of a real run has them."""

    def __init__(self, hidden: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        self.batches_seen += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)}


def loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)) for _ in range(STEPS)]
    return torch.utils.data.DataLoader(data, batch_size=None)


def trainer(max_steps: int, callbacks: list[Any], root: Path) -> Any:
    return pl.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def fit(save: Path, *extra: Any) -> Path:
    """Lightning's default way to save: ``ModelCheckpoint`` every EVERY steps, every one kept, and last.ckpt."""
    torch.manual_seed(0)
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=save, every_n_train_steps=EVERY, save_top_k=-1, save_last=True
    )
    trainer(STEPS, [ckpt, *extra], save.parent).fit(Tiny(), loader())
    return save


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``plain``: ModelCheckpoint alone; ``pma``: with pmakit's PMACallback, which records the tokens."""
    from pmakit.integrations.lightning import PMACallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("lightning")
    pma = PMACallback(root / "snaps", 10**9, count_tokens=lambda batch: TOKENS_PER_BATCH)
    return {"plain": fit(root / "plain"), "pma": fit(root / "pma", pma), "root": root}


def invoke(*args: Any) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


def inspect_json(*args: Any) -> dict[str, Any]:
    r = invoke("inspect", *args, "--json", "--all")
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.stdout))


def test_found_in_a_folder_and_one_by_one(runs: dict[str, Path]) -> None:
    files = sorted(p.name for p in runs["plain"].iterdir())
    assert files == [f"epoch=0-step={s}.ckpt" for s in (12, 4, 8)] + ["last.ckpt"]
    report = inspect_json(runs["plain"], "--tokens-per-step", 16)
    rows = report["snapshots"]
    # last.ckpt is the newest save again: listed once, not as a second snapshot at the same tokens.
    assert [(Path(r["path"]).name, r["layout"], r["step"], r["tokens"]) for r in rows] == [
        (f"epoch=0-step={s}.ckpt", "lightning", s, 16 * s) for s in (4, 8, 12)
    ]
    assert all("epoch=0-step=4.ckpt:optimizer_states" in r["skipped_entries"] for r in rows[:1])
    one = inspect_json(runs["plain"] / "epoch=0-step=8.ckpt", "--tokens-per-step", 16)
    assert [(r["step"], r["tokens"]) for r in one["snapshots"]] == [(8, 128)]

    # No token count and no flag: one line that says what to do.
    r = invoke("merge", runs["plain"], "-o", runs["root"] / "never")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and [x for x in lines if x.startswith("Error")] == lines[-1:], r.output
    assert "--tokens-per-step" in lines[-1] and "Traceback" not in r.output
    assert not (runs["root"] / "never").exists()


def test_tokens_recorded_by_the_pmakit_callback(runs: dict[str, Path], tmp_path: Path) -> None:
    rows = inspect_json(runs["pma"])["snapshots"]
    assert [(r["step"], r["tokens"]) for r in rows] == [(s, s * TOKENS_PER_BATCH) for s in (4, 8, 12)]
    # No flags at all: the folder (all 3), and two files named one by one (both used).
    files = [runs["pma"] / f"epoch=0-step={s}.ckpt" for s in (4, 8, 12)]
    for name, inputs, used in (("all", [runs["pma"]], files), ("two", files[1:], files[1:])):
        r = invoke("merge", *inputs, "-o", tmp_path / name)
        assert r.exit_code == 0, r.output
        merged = torch.load(tmp_path / name / "model.ckpt", weights_only=True)["state_dict"]
        for k, v in hand_average(used).items():
            torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)


def hand_average(files: list[Path]) -> dict[str, torch.Tensor]:
    states = [torch.load(f, weights_only=True)["state_dict"] for f in files]
    return {
        k: torch.stack([s[k] for s in states]).mean(0) if v.is_floating_point() else v
        for k, v in states[-1].items()
    }


def test_merge_resumes_with_trainer_fit(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "merged"
    r = invoke("merge", runs["plain"], "-o", out, "--tokens-per-step", 16)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["model.ckpt", "pmakit-merge.json"]
    inputs = [runs["plain"] / f"epoch=0-step={s}.ckpt" for s in (4, 8, 12)]
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert [i["path"] for i in manifest["inputs"]] == [str(p) for p in inputs]
    want = hand_average(inputs)
    merged = torch.load(out / "model.ckpt", weights_only=True)
    newest = torch.load(inputs[-1], weights_only=True)
    assert list(merged["state_dict"]) == list(newest["state_dict"])
    for k, v in want.items():
        torch.testing.assert_close(merged["state_dict"][k], v, rtol=0, atol=1e-6)
    assert not torch.equal(merged["state_dict"]["net.0.weight"], newest["state_dict"]["net.0.weight"])
    assert int(merged["state_dict"]["batches_seen"]) == STEPS  # a counter: the newest's
    # The rest is the newest snapshot's: its step, optimizer moments, lr schedule, loops.
    assert merged["global_step"] == STEPS and merged["hyper_parameters"] == newest["hyper_parameters"]
    torch.testing.assert_close(merged["optimizer_states"], newest["optimizer_states"], rtol=0, atol=0)
    assert merged["lr_schedulers"] == newest["lr_schedulers"] and merged["loops"] == newest["loops"]

    loaded = Tiny.load_from_checkpoint(out / "model.ckpt")
    for k, v in want.items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=1e-6)

    seen: dict[str, Any] = {}

    class Look(pl.Callback):  # type: ignore[misc,name-defined]
        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen["step"] = trainer.global_step
            seen["weights"] = {k: v.clone() for k, v in module.state_dict().items()}

    module = Tiny()
    resumed = trainer(STEPS + 1, [Look()], tmp_path)
    resumed.fit(module, loader(), ckpt_path=out / "model.ckpt")
    assert seen["step"] == STEPS and resumed.global_step == STEPS + 1  # resumed, then one step trained
    for k, v in want.items():
        torch.testing.assert_close(seen["weights"][k], v, rtol=0, atol=1e-6)
    assert not torch.equal(module.net[0].weight, seen["weights"]["net.0.weight"])
    assert torch.isfinite(module.net[0].weight).all()


class _Run:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_arbitrary_pickles_are_refused_unrun(tmp_path: Path) -> None:
    bad = tmp_path / "run" / "epoch=0-step=4.ckpt"
    bad.parent.mkdir()
    torch.save({"state_dict": {"w": torch.ones(2)}, "global_step": 4, "hyper_parameters": _Run()}, bad)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        r = invoke("merge", bad, "-o", tmp_path / "out", "--tokens-per-step", 8)
    finally:
        os.chdir(cwd)
    assert r.exit_code != 0 and not (tmp_path / "pwned").exists()
    assert r.stderr.count("\n") == 1 and "refused" in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(bad, weights_only=True)


def test_format_lightning_needs_a_lightning_newest_input(runs: dict[str, Path], tmp_path: Path) -> None:
    """The .ckpt written is the newest input's with the merged weights: other inputs are refused before any work."""
    from conftest import state, write_snapshot

    other = write_snapshot(tmp_path / "step-10", state(1), step=10, tokens=100)
    r = invoke("merge", other, "-o", tmp_path / "out", "--format", "lightning")
    assert r.exit_code == 1 and not (tmp_path / "out").exists()
    (line,) = [x for x in r.stderr.splitlines() if not x.startswith("info: ")]
    assert line.startswith("Error: --format lightning rewrites the newest input's Lightning .ckpt") and (
        "use --format safetensors" in line
    ), line
    # --format safetensors of Lightning inputs: HF safetensors under the LightningModule's names.
    r = invoke("merge", runs["pma"], "-o", tmp_path / "st", "--format", "safetensors")
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    got = load_file(tmp_path / "st" / "model.safetensors")
    files = [runs["pma"] / f"epoch=0-step={s}.ckpt" for s in (4, 8, 12)]
    want = hand_average(files)
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)
