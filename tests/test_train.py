"""The training loop: snapshots at the right tokens, online merge == pmakit merge, resume, fork, rollback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from pmakit.errors import PmakitError
from pmakit.merge import merge
from pmakit.metrics import read_metrics
from pmakit.snapshot import discover
from pmakit.train.loop import Callback, StopTraining, TrainConfig, Trainer
from pmakit.train.model import ModelConfig
from pmakit.weights import get_weights

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(3000))


@pytest.fixture
def corpus_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PMAKIT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(8):
        (d / f"m{i}.py").write_text(TEXT[i * 15000 : (i + 1) * 15000 + 40000])
    return d


def tiny(corpus: Path, **kw: object) -> TrainConfig:
    base: dict[str, object] = dict(
        corpus=str(corpus), vocab_size=300, val_fraction=0.25, max_corpus_bytes=None,
        model=ModelConfig(layers=1, hidden=32, heads=2, seq_len=32), batch_size=4, total_tokens=128 * 24,
        lr=3e-3, warmup_tokens=256, every_tokens=128 * 3, average_last=3, eval_every=2, eval_batches=2,
        threads=1, log_every=1,
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def test_snapshots_land_every_v_tokens_and_load_in_transformers(corpus_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    cfg = tiny(corpus_dir)
    Trainer(cfg, run).fit().close()
    snaps = discover(run)
    # 128 tokens a step, V = 384 tokens = 3 steps: 24 steps -> snapshots at steps 3, 6, ..., 24
    assert [s.tokens for s in snaps] == [384 * k for k in range(1, 9)]
    assert [s.step for s in snaps] == [3 * k for k in range(1, 9)]
    model = AutoModelForCausalLM.from_pretrained(snaps[-1].path)
    tok = AutoTokenizer.from_pretrained(snaps[-1].path)
    ids = tok("def f(x):", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == 300


def test_online_merge_equals_pmakit_merge_and_is_logged(corpus_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = Trainer(tiny(corpus_dir), run)
    trainer.fit()
    trainer.close()
    snaps = discover(run)[-3:]
    merged = merge(snaps, get_weights("sma", 3), tmp_path / "m")
    from safetensors.torch import load_file

    reference = load_file(merged.path / "model.safetensors")
    online = trainer.averager.average()
    for k, v in reference.items():
        torch.testing.assert_close(online[k].float(), v.float(), rtol=1e-6, atol=1e-6)
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert {r["model"] for r in evals} == {"latest", "merged:sma:3"}
    merged_rows = [r for r in evals if r["model"] == "merged:sma:3"]
    assert all(r["val_loss"] > 0 and "delta_se" in r for r in merged_rows)


def test_resume_continues_exactly(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = tiny(corpus_dir)
    straight = Trainer(cfg, tmp_path / "a")
    straight.fit()
    straight.close()

    class Crash(Callback):
        def on_step_end(self, trainer: Trainer, record: dict[str, object]) -> None:
            if trainer.step == 13:
                raise KeyboardInterrupt

    first = Trainer(cfg, tmp_path / "b", callbacks=[Crash()])
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    first.close()
    second = Trainer(cfg, tmp_path / "b")
    assert second.step == 13  # the interrupt saved the state at the step it stopped
    second.fit()
    second.close()
    for k, v in straight.model.state_dict().items():
        torch.testing.assert_close(second.model.state_dict()[k], v, rtol=0, atol=0)
    assert [s.tokens for s in discover(tmp_path / "b")] == [s.tokens for s in discover(tmp_path / "a")]


def test_rollback_and_stop(corpus_dir: Path, tmp_path: Path) -> None:
    rolled: dict[str, dict[str, torch.Tensor]] = {}

    class Roll(Callback):
        def on_step_end(self, trainer: Trainer, record: dict[str, object]) -> None:
            if trainer.step == 10:
                average = trainer.averager.average()
                rolled["from"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
                trainer.rollback(average, optimizer="reset", reason={"why": "test"})
                rolled["to"] = {k: v.clone() for k, v in average.items()}
                rolled["model"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
                trainer.set_lr_factor(0.5, trainer.tokens + 256)
            if trainer.step == 15:
                raise StopTraining("enough")

    run = tmp_path / "run"
    trainer = Trainer(tiny(corpus_dir), run, callbacks=[Roll()])
    trainer.fit()
    trainer.close()
    events = [r for r in read_metrics(run) if r["kind"] == "event"]
    assert [e["event"] for e in events] == ["rollback", "stop"]
    assert events[0]["why"] == "test" and trainer.step == 15
    # the model took the averaged weights (the online merge, not the step-10 weights it had)
    to, model = rolled["to"], rolled["model"]
    assert to and all(torch.equal(model[k], to[k].to(model[k].dtype)) for k in to)
    assert any(not torch.equal(rolled["from"][k], model[k]) for k in to)
    # lowered from the rollback (1280 tokens) until 1536 tokens, scheduled after
    assert trainer.lr_at(1500) == pytest.approx(trainer.schedule(1500) * 0.5)
    assert trainer.lr_at(1600) == pytest.approx(trainer.schedule(1600))


def test_bf16_autocast_trains_in_bf16_and_keeps_weights_snapshots_and_evals_fp32(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[torch.dtype] = []
    original = torch.nn.functional.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        out = original(x, w, b)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    fp32 = Trainer(tiny(corpus_dir, total_tokens=128 * 6, eval_every=0), tmp_path / "a").fit()
    fp32.close()
    assert set(seen) == {torch.float32}
    seen.clear()
    bf16 = Trainer(
        tiny(corpus_dir, total_tokens=128 * 6, eval_every=0, precision="bf16"), tmp_path / "b"
    ).fit()
    bf16.close()
    assert set(seen) == {torch.bfloat16}  # the step's matmuls ran in bf16
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    from safetensors.torch import load_file  # snapshots hold the fp32 master weights, not bf16 copies

    snap = load_file(discover(tmp_path / "b")[-1].path / "model.safetensors")
    assert {v.dtype for v in snap.values()} == {torch.float32}
    # Not the same trajectory, but the same training: the losses stay close after 6 steps.
    a, b = ([r for r in read_metrics(tmp_path / d) if r["kind"] == "train"][-1]["loss"] for d in ("a", "b"))
    assert abs(a - b) < 0.1 * a
    seen.clear()
    from pmakit.evaluate import evaluate

    evaluate(bf16.model, [(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))])
    assert set(seen) == {torch.float32}  # evaluation is outside the autocast
    from pmakit.evaluate import native_bf16

    auto = Trainer(tiny(corpus_dir, total_tokens=128 * 6, eval_every=0, precision="auto"), tmp_path / "c")
    assert auto.bf16 == native_bf16() and auto.describe()["precision"] == (
        "bf16 autocast" if auto.bf16 else "fp32"
    )
    auto.close()


def test_bad_config_is_one_error(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PmakitError, match="multiple of the tokens per step"):
        tiny(corpus_dir, every_tokens=100)
    with pytest.raises(PmakitError, match="unknown train config keys: lr_max"):
        TrainConfig.from_dict({"lr_max": 1})
    with pytest.raises(PmakitError, match="unknown train.model config keys: hiden; known: .*heads, hidden"):
        TrainConfig.from_dict({"model": {"hiden": 32}})
    with pytest.raises(PmakitError, match="train.precision must be fp32, bf16 or auto, got 'fp16'"):
        tiny(corpus_dir, precision="fp16")
    # The averaging hook reads the window back from disk: the trainer may not delete it first.
    with pytest.raises(PmakitError, match="keep_last=2 < last=3"):
        Trainer(tiny(corpus_dir, keep_last=2), tmp_path / "run")


def test_train_cli_writes_a_run_and_resumes(corpus_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "preset: smoke\ntrain:\n  corpus: " + str(corpus_dir) + "\n  vocab_size: 300\n  val_fraction: 0.25\n"
        "  max_corpus_bytes: null\n  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}\n  batch_size: 4\n"
        "  total_tokens: 1536\n  warmup_tokens: 128\n  every_tokens: 256\n  eval_every: 2\n  eval_batches: 2\n"
    )
    env_cache = {"PMAKIT_CACHE": str(tmp_path / "cache")}
    proc = run_cli("train", config, "-o", tmp_path / "run", env=env_cache)
    assert proc.returncode == 0, proc.stderr
    assert "trained 1,536 tokens" in proc.stdout
    assert len(discover(tmp_path / "run")) == 6
    state = json.loads((tmp_path / "run" / "checkpoint" / "pmakit.json").read_text())
    assert state["tokens"] == 1536
    # its report: the curves, the online merge's evaluations, the snapshots (not an experiment's empty report)
    report = run_cli("report", tmp_path / "run")
    assert report.returncode == 0, report.stderr
    assert "6 snapshots" in report.stdout and "online merge (sma:" in report.stdout
    md = (tmp_path / "run" / "report.md").read_text()
    assert (
        "missing" not in md and "| 1.536K |" in md and "6 snapshots in `snapshots/`, every 256 tokens" in md
    )
    assert (tmp_path / "run" / "plots" / "train_curves.png").stat().st_size > 0
    trained = sorted((f.relative_to(tmp_path), f.stat().st_mtime_ns) for f in (tmp_path / "run").rglob("*"))
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = run_cli("train", config, "-o", tmp_path / "run", env=env_cache)
    assert again.returncode == 0 and "trained 1,536 tokens" in again.stdout  # nothing left to do
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # no step trained again
    snapshots = [(f, t) for f, t in trained if f.parts[1:2] == ("snapshots",)]
    assert snapshots and all((tmp_path / f).stat().st_mtime_ns == t for f, t in snapshots)
    bad = run_cli("train", config, "-o", tmp_path / "r2", "--corpus", tmp_path / "missing", env=env_cache)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and bad.stderr.startswith("Error: ")


def test_compiled_evaluation_scores_swapped_states_like_eager_and_falls_back(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The experiment's ``compile_eval``: one compile per model, every swapped-in state scored as the eager forward
    scores it (weights are the graph's inputs, not constants baked in), and a compiler failure costs a warning."""
    from pmakit.evaluate import evaluate
    from pmakit.train.loop import swapped

    trainer = Trainer(tiny(corpus_dir, total_tokens=128 * 6, eval_every=0), tmp_path / "a").fit()
    trainer.close()
    model, batches = trainer.model, trainer.val
    states = [
        {k: v + 0.01 * i * torch.randn_like(v) for k, v in model.state_dict().items()} for i in range(3)
    ]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for state in states:
        with swapped(model, state):
            eager = evaluate(model, batches)
            compiled = evaluate(model, batches, compiled=True)
        assert compiled.batch_losses == pytest.approx(eager.batch_losses, rel=1e-5, abs=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # compiled once, reused for every state
    assert model.training and "_pmakit_eval_forward" not in model.state_dict()

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no C++ compiler\nmore detail")

    fresh = Trainer(tiny(corpus_dir, total_tokens=128 * 3, eval_every=0), tmp_path / "b")
    fresh.close()
    monkeypatch.setattr(torch, "compile", lambda model, **kw: broken)
    with caplog.at_level("WARNING"):
        result = evaluate(fresh.model, fresh.val, compiled=True)
    assert result.batch_losses == evaluate(fresh.model, fresh.val).batch_losses
    assert "torch.compile failed (RuntimeError: no C++ compiler): evaluating without it" in caplog.text
    from pmakit.lab.pma import ExperimentConfig

    with pytest.raises(PmakitError, match="experiment.compile_eval must be off, on or auto, got 'yes'"):
        ExperimentConfig(compile_eval="yes")
    assert not ExperimentConfig().compiled and ExperimentConfig(compile_eval="on").compiled


def test_compiled_training_follows_eager_training_and_falls_back(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``train.compile``: the compiled step's losses and weights follow the eager run's (same data, same init; only
    floating-point order differs), compiled once for the run; a compiler failure costs a warning, then eager."""
    cfg = dict(total_tokens=128 * 8, eval_every=0, warmup_tokens=0, precision="fp32")
    eager = Trainer(tiny(corpus_dir, **cfg), tmp_path / "eager").fit()
    eager.close()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = Trainer(tiny(corpus_dir, compile="on", **cfg), tmp_path / "compiled").fit()
    compiled.close()
    assert (
        compiled.compiled and compiled.describe()["compile"] != "off" and eager.describe()["compile"] == "off"
    )
    assert counters["stats"]["unique_graphs"] == 1  # one graph for the whole run
    losses = [[r["loss"] for r in read_metrics(t.run_dir) if r["kind"] == "train"] for t in (eager, compiled)]
    assert len(losses[0]) == 8 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    for k, v in eager.model.state_dict().items():
        assert torch.allclose(compiled.model.state_dict()[k], v, rtol=1e-3, atol=1e-5), k

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: broken)
    with caplog.at_level("WARNING"):
        fallback = Trainer(tiny(corpus_dir, compile="on", **cfg), tmp_path / "fallback").fit()
    fallback.close()
    assert caplog.text.count("torch.compile failed (RuntimeError: no C++ compiler): training without it") == 1
    assert [r["loss"] for r in read_metrics(fallback.run_dir) if r["kind"] == "train"] == losses[0]
    with pytest.raises(PmakitError, match="train.compile must be off, on or auto, got 'yes'"):
        tiny(corpus_dir, compile="yes")
    # auto: only where kernels can be built and the steps left repay the compile (8 steps here do not)
    import pmakit.train.loop as loop

    short = Trainer(tiny(corpus_dir, compile="auto", **cfg), tmp_path / "auto")
    short.close()
    assert not short.compiled
    monkeypatch.setattr(loop, "AUTO_COMPILE_STEPS", 8)
    monkeypatch.setattr(loop, "can_compile", lambda: True)
    long = Trainer(tiny(corpus_dir, compile="auto", **cfg), tmp_path / "auto2")
    long.close()
    assert long.compiled


def test_a_copy_that_is_not_the_writer_leaves_the_writers_save_in_flight_alone(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """A restarted model copy (not the writer) sets up its trainer while the writer may be saving: the hidden
    directory of that save is not a leftover to remove (seen once in CI: the writer's rename then failed)."""
    from pmakit.train.replicas import SingleCopy

    class SecondCopy(SingleCopy):
        rank = 1
        size = 2

        @property
        def is_writer(self) -> bool:
            return False

    run = tmp_path / "run"
    in_flight = run / "snapshots" / ".step-00000040.pmakit-partial"
    in_flight.mkdir(parents=True)
    (in_flight / "model.safetensors").write_bytes(b"being written")
    Trainer(tiny(corpus_dir), run, copies=SecondCopy()).close()
    assert (in_flight / "model.safetensors").exists()
    Trainer(tiny(corpus_dir), run).close()  # the writer, restarted, tidies its own leftovers
    assert not in_flight.exists()


def test_resume_from_and_init_from_take_the_model_of_the_weights(corpus_dir: Path, tmp_path: Path) -> None:
    # A run of a model other than the demo's; a new run from its checkpoint or its merge, no config given.
    config = tmp_path / "c.yaml"
    config.write_text(
        "preset: smoke\ntrain:\n  corpus: " + str(corpus_dir) + "\n  vocab_size: 300\n  val_fraction: 0.25\n"
        "  max_corpus_bytes: null\n  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}\n  batch_size: 4\n"
        "  total_tokens: 768\n  warmup_tokens: 128\n  every_tokens: 256\n  eval_every: 2\n  eval_batches: 2\n"
    )
    env = {"PMAKIT_CACHE": str(tmp_path / "cache")}
    run = tmp_path / "run"
    assert run_cli("train", config, "-o", run, env=env).returncode == 0
    assert run_cli("merge", run, "-o", tmp_path / "m", "-q").returncode == 0
    merged = tmp_path / "elsewhere" / "m"  # away from the run: the merge's manifest leads back to it
    merged.parent.mkdir()
    (tmp_path / "m").rename(merged)
    init = run_cli("train", "--init-from", merged, "-o", tmp_path / "init", env=env)
    assert init.returncode == 0, init.stderr
    assert f"config: from the run {run}" in init.stderr and "trained 768 tokens" in init.stdout
    fork = run_cli("train", "--resume-from", run / "checkpoint", "-o", tmp_path / "fork", env=env)
    assert fork.returncode == 0, fork.stderr
    assert "checkpoint" in fork.stderr and "trained 768 tokens" in fork.stdout
    # a config that says otherwise: one line
    other = tmp_path / "other.yaml"
    other.write_text(config.read_text().replace("hidden: 32", "hidden: 64"))
    bad = run_cli("train", other, "--init-from", merged, "-o", tmp_path / "bad", env=env)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.splitlines()[-1].startswith("Error: ") and "another model size" in bad.stderr


def test_source_config_falls_back_to_the_weights_config_json(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    from pmakit.train.loop import source_config

    LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    ).save_pretrained(tmp_path)  # fmt: skip
    found = source_config(tmp_path)
    assert found is not None
    section, where = found
    model = TrainConfig.from_dict(section).model
    assert (model.layers, model.hidden, model.heads, model.kv_heads, model.mlp_width) == (1, 32, 2, 1, 96)
    assert (model.seq_len, model.tie_embeddings, section["vocab_size"]) == (32, False, 300)
    assert "config.json" in where and "demo preset" in where
    assert source_config(tmp_path / "nothing") is None


def test_a_run_resumes_after_it_is_moved_and_named_from_elsewhere(
    corpus_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trained as ``-o work/tiny`` (relative), stopped at step 13, moved, and resumed by its new path from another
    working directory: the uninterrupted run's weights and merges (the run had kept the paths it was given, and
    the resume was a FileNotFoundError: 'work/tiny/snapshots/step-...'); a relative corpus is recorded absolute.
    An older run's state, which kept the paths as given, still resumes after a move."""
    import dataclasses
    import os
    import shutil

    from safetensors.torch import load_file

    from pmakit.train.averaging import Averaging

    cfg = tiny(corpus_dir)
    straight = Trainer(cfg, tmp_path / "straight").fit()
    straight.close()

    class Stop(Callback):
        def on_step_end(self, trainer: Trainer, record: dict[str, object]) -> None:
            if trainer.step == 13:
                raise KeyboardInterrupt

    first, elsewhere = tmp_path / "a", tmp_path / "b"
    first.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(first)
    here = dataclasses.replace(cfg, corpus=os.path.relpath(corpus_dir))  # relative too, outside the run
    stopped = Trainer(here, "work/tiny", callbacks=[Stop()])
    with pytest.raises(KeyboardInterrupt):
        stopped.fit()
    stopped.close()
    monkeypatch.chdir(tmp_path)
    saved = torch.load(first / "work/tiny/checkpoint/trainer.pt", weights_only=True)
    assert saved["config"]["corpus"] == str(corpus_dir)
    assert saved["averager"]["window"] == [[384 * k, f"step-{3 * k:08d}"] for k in (2, 3, 4)]
    assert saved["saver"]["last_saved"]["path"] == "step-00000012"
    snapshot_records = [r for r in read_metrics(first / "work/tiny") if r["kind"] == "snapshot"]
    assert snapshot_records[0]["path"] == "snapshots/step-00000003"  # relative to the run, as the window
    shutil.move(first / "work" / "tiny", elsewhere / "moved")

    # An older run kept the paths as given (relative to its working directory): found in the moved run by name.
    older = Averaging(elsewhere / "moved" / "snapshots", cfg.every_tokens, last=cfg.average_last)
    older.start(None, 13 * 128, rebuild=False, writer=False)
    legacy = {k: v for k, v in saved.items() if k != "paths"}
    legacy["averager"] = {
        **saved["averager"],
        "window": [[t, f"work/tiny/{p}"] for t, p in legacy["averager"]["window"]],
    }
    older.load_state_dict(legacy)
    assert [p for _, p in older.averager.window] == [
        elsewhere / "moved" / "snapshots" / f"step-{3 * k:08d}" for k in (2, 3, 4)
    ]

    # the straight run trained in this process, on the CPU's own kernels: the CLI's AVX2 pin off, for equal bits
    kernels = {"ATEN_CPU_CAPABILITY": torch.backends.cpu.get_cpu_capability().lower(), "MKL_CBWR": "AUTO"}
    resumed = run_cli("train", "-o", "moved", cwd=elsewhere, env=kernels)  # the config saved in the run
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert "trained 3,072 tokens" in resumed.stdout
    continued = re.search(r"resumed \S*moved at (\d+) tokens \(step (\d+)\)", resumed.stderr)
    assert continued and int(continued[2]) > 0, resumed.stderr[-3000:]  # not started over
    moved = elsewhere / "moved"
    assert [s.tokens for s in discover(moved)] == [s.tokens for s in discover(tmp_path / "straight")]
    final = f"snapshots/step-{24:08d}/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(moved / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want = {
        r["step"]: r["val_loss"]
        for r in read_metrics(tmp_path / "straight")
        if r["kind"] == "eval" and r["model"].startswith("merged")
    }
    got = {
        r["step"]: r["val_loss"]
        for r in read_metrics(moved)
        if r["kind"] == "eval" and r["model"].startswith("merged")
    }
    assert got.keys() == want.keys() and max(want) == 24
    assert got == pytest.approx(want, rel=1e-5)  # the resumed window's sums are rebuilt from the moved files
