"""pmakit eval on the real lm-evaluation-harness: a tiny trained run, its held-out tasks, both doors, known answers."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import SRC, cli_env, run_cli

pytest.importorskip("lm_eval")

from pmakit.errors import PmakitError
from pmakit.eval import stats
from pmakit.eval.run import _finished
from pmakit.merge.recipe import parse_recipe, resolve
from pmakit.runs import read_jsonl
from pmakit.snapshot import gather

LINES = "".join(f"def f{i}(x):\n    y = x * {i}\n    return y + {i % 7}  # line {i}\n" for i in range(2400))
TASKS = "pmakit_next_line,pmakit_bpb"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A corpus of 8 files and a 10-snapshot constant-LR run on it (a 1-layer Llama, seconds)."""
    from pmakit.train.loop import TrainConfig, Trainer
    from pmakit.train.model import ModelConfig

    root = tmp_path_factory.mktemp("eval")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text(LINES[i * 12000 : (i + 1) * 12000 + 30000])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PMAKIT_CACHE", str(root / "cache"))
        cfg = TrainConfig(
            corpus=str(corpus), vocab_size=300, val_fraction=0.3, max_corpus_bytes=None,
            model=ModelConfig(layers=1, hidden=32, heads=2, seq_len=64), batch_size=4, total_tokens=256 * 20,
            lr=3e-3, warmup_tokens=256, every_tokens=256 * 2, eval_every=0, threads=1, log_every=10,
        )  # fmt: skip
        trainer = Trainer(cfg, root / "run", progress=False)
        trainer.fit()
        trainer.saver.wait()
        trainer.close()
    yield {"root": root, "run": root / "run", "env": {"PMAKIT_CACHE": str(root / "cache"), **OFFLINE}}


def _eval(
    tiny: dict[str, Path], *args: Any, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_cli("eval", *args, env={**tiny["env"], **(env or {})}, timeout=1200)  # type: ignore[dict-item]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _value(rows: list[dict[str, Any]], recipe: str, task: str, metric: str) -> float:
    (row,) = [r for r in rows if r["recipe"] == recipe and r["task"] == task and r["metric"] == metric]
    return float(row["value"])


# --- the recipe grammar


def test_recipes_resolve_to_the_selection_and_weightings_of_merge(make_run: Any, tmp_path: Path) -> None:
    snapshots, _ = gather([make_run(6)])
    tokens = [s.tokens for s in snapshots]  # 1000, 2000, ... 6000
    assert [s.tokens for s in resolve(parse_recipe("latest"), snapshots).snapshots] == [6000]
    assert [s.tokens for s in resolve(parse_recipe("back:2"), snapshots).snapshots] == [4000]
    sma = resolve(parse_recipe("sma:3"), snapshots)
    assert [s.tokens for s in sma.snapshots] == tokens[-3:] and sma.weights == (1 / 3,) * 3
    assert sma.key["window"] == [4000, 6000] and sma.key["v"] == 1000 and sma.key["n"] == 3
    # every=2000 from the newest: [2000, 4000, 6000]
    assert [s.tokens for s in resolve(parse_recipe("sma:3:every=2K"), snapshots).snapshots] == [
        2000,
        4000,
        6000,
    ]
    ema = resolve(parse_recipe("ema:0.5:3"), snapshots)
    assert ema.weights == pytest.approx((0.25, 0.25, 0.5))
    wsm = resolve(parse_recipe("wsm:1-sqrt:4"), snapshots)
    assert wsm.recipe.method == "wsm-1sqrt" and sum(wsm.weights) == pytest.approx(1)
    assert resolve(parse_recipe("sma:3:until=5000"), snapshots).key["window"] == [3000, 5000]
    tune = tmp_path / "tuned"
    tune.mkdir()
    merge = {"tokens": [3000, 5000], "weights": [0.25, 0.75]}
    (tune / "tune.json").write_text(json.dumps({"models": {"tuned": {"merge": merge}}}))
    tuned = resolve(parse_recipe(str(tune)), snapshots)
    assert [s.tokens for s in tuned.snapshots] == [3000, 5000] and tuned.weights == (0.25, 0.75)
    for bad, says in (("sma:7", "needs 7 snapshots"), ("back:6", "needs 7"), ("sma:x", "cannot read"),
                      ("wsm:square:3", "unknown decay shape"), ("sma:3:every=2K:by=1", "unknown option"),
                      ("nonsense", "cannot read the recipe")):  # fmt: skip
        with pytest.raises(PmakitError, match=says):
            resolve(parse_recipe(bad), snapshots)


# --- statistics against hand computations


def test_paired_difference_and_its_se_equal_a_hand_computation() -> None:
    a = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    b = [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    d = [x - y for x, y in zip(a, b)]  # 1, 0, 0, 1, -1, 1: mean 1/3
    mean = sum(d) / 6
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 5 / 6)
    got = stats.paired("acc", a, b)
    assert got.delta == pytest.approx(1 / 3, abs=1e-15) and got.se == pytest.approx(se, abs=1e-15)
    assert got.low <= got.delta <= got.high and got.items == 6
    value, value_se = stats.score("acc", a)
    assert value == pytest.approx(4 / 6) and value_se == pytest.approx(math.sqrt((4 / 6) * (2 / 6) / 5))
    # bits per byte: -sum(ll) / sum(bytes) / ln 2, as lm-eval aggregates it
    items = [[-10.0, 8], [-30.0, 12], [-5.0, 10]]
    assert stats.score("bits_per_byte", items)[0] == pytest.approx(45 / 30 / math.log(2))
    band = stats.noise_band([0.30, 0.32, 0.25])
    assert band["sd"] == pytest.approx(float(np.std([0.30, 0.32, 0.25], ddof=1))) and band["k"] == 3


def test_a_corpus_with_another_tokenizer_than_the_snapshots_is_refused(tmp_path: Path) -> None:
    """A corpus rebuilt from a run's config by another pmakit version may be another text: its "held-out" files
    could be training files of the model."""
    from pmakit.eval.run import check_tokenizer

    entry, snapshot = tmp_path / "entry", tmp_path / "snap"
    (entry / "tokenizer").mkdir(parents=True)
    snapshot.mkdir()
    (entry / "tokenizer" / "tokenizer.json").write_text(
        json.dumps({"model": {"vocab": {"a": 0}, "merges": []}})
    )
    (snapshot / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}, "merges": []}}))
    check_tokenizer(entry, snapshot)
    (snapshot / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"b": 0}, "merges": []}}))
    with pytest.raises(PmakitError, match="another tokenizer than its snapshots"):
        check_tokenizer(entry, snapshot)


def test_a_task_counts_as_finished_only_with_all_its_metrics() -> None:
    row = {"target": "t", "recipe": "latest", "task": "x", "metrics": ["acc", "acc_norm"]}
    assert not _finished([{**row, "metric": "acc"}])
    assert len(next(iter(_finished([{**row, "metric": "acc"}, {**row, "metric": "acc_norm"}]).values()))) == 2


# --- the two doors on the tiny run


@pytest.fixture(scope="module")
def evaluated(tiny: dict[str, Path]) -> dict[str, Any]:
    """`pmakit eval RUN --merge sma:4` through the real CLI: 3 models (sma:4, latest, back:1) x 2 tasks."""
    out = tiny["root"] / "results" / "evals.jsonl"
    proc = _eval(
        tiny, tiny["run"], "--merge", "sma:4", "--tasks", TASKS, "--limit", "24", "--noise", "2", "-o", out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "proc": proc, "rows": _rows(out)}


def test_cli_evaluates_merges_in_memory_with_paired_differences(evaluated: dict[str, Any]) -> None:
    rows, proc = evaluated["rows"], evaluated["proc"]
    assert sorted({r["recipe"] for r in rows}) == ["back:1", "latest", "sma:4"]
    assert sorted({r["metric"] for r in rows}) == ["acc", "acc_norm", "bits_per_byte", "byte_perplexity"]
    assert len(rows) == 12 and {r["how"] for r in rows} == {"in memory"}
    for r in rows:
        assert r["items_n"] == 24 and r["limit"] == 24 and r["split"] == "test" and r["lm_eval"] == "0.4.13"
        assert r["our_value"] == pytest.approx(
            r["value"], rel=1e-12
        )  # our aggregate of the items is lm-eval's
        if r["metric"] == "acc":
            assert r["se"] == pytest.approx(r["lm_eval_stderr"], rel=1e-12)
            assert r["task_info"]["chance"] == 0.25 and r["task_info"]["items"] >= 24
    sma = next(r for r in rows if r["recipe"] == "sma:4")
    assert sma["n"] == 4 and sma["window"][1] - sma["window"][0] == 3 * sma["v"]
    assert "Δ vs latest" in proc.stdout and "in memory" in proc.stdout and "noise sd" in proc.stdout


def test_lm_evals_own_api_takes_model_pmakit(
    tiny: dict[str, Path], evaluated: dict[str, Any], monkeypatch: Any
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import pmakit.eval  # noqa: F401  (registers model="pmakit")
    from pmakit.eval.run import corpus_entry
    from pmakit.eval.tasks import build_tasks

    monkeypatch.setenv("PMAKIT_CACHE", tiny["env"]["PMAKIT_CACHE"])  # type: ignore[index]
    include = build_tasks(corpus_entry([tiny["run"]])).include("test")
    out = lm_eval.simple_evaluate(
        model="pmakit", model_args=f"run={tiny['run']},merge=sma:4", tasks=["pmakit_next_line", "pmakit_bpb"],
        task_manager=TaskManager(include_path=str(include)), limit=24,
    )  # fmt: skip
    rows = evaluated["rows"]
    for task, metric in (
        ("pmakit_next_line", "acc"),
        ("pmakit_next_line", "acc_norm"),
        ("pmakit_bpb", "bits_per_byte"),
    ):
        assert out["results"][task][f"{metric},none"] == _value(rows, "sma:4", task, metric)


def test_in_memory_merge_scores_as_the_same_merge_written_and_loaded(
    tiny: dict[str, Path], evaluated: dict[str, Any]
) -> None:
    merged = tiny["root"] / "merged"
    proc = run_cli("merge", tiny["run"], "--last", "4", "-o", merged)
    assert proc.returncode == 0, proc.stderr
    out = tiny["root"] / "disk.jsonl"
    proc = _eval(tiny, merged, "--tasks", TASKS, "--limit", "24", "-o", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    via = _eval(tiny, tiny["run"], "--merge", "sma:4", "--tasks", TASKS, "--limit", "24", "--noise", "0",
                "-o", tiny["root"] / "via.jsonl", env={"PMAKIT_EVAL_VIA_DISK": "1"})  # fmt: skip
    assert via.returncode == 0, via.stderr[-3000:]
    disk, through = _rows(out), _rows(tiny["root"] / "via.jsonl")
    assert {r["how"] for r in disk} == {"loaded"} and {r["how"] for r in through} == {
        "via a temporary folder (removed)"
    }
    assert not list(tiny["run"].glob("snapshots/.pmakit-eval-*"))
    for row in disk:
        in_memory = _value(evaluated["rows"], "sma:4", row["task"], row["metric"])
        assert row["value"] == in_memory and row["items"] == next(
            r["items"] for r in evaluated["rows"] if r["recipe"] == "sma:4" and r["metric"] == row["metric"]
        )
        assert _value(through, "sma:4", row["task"], row["metric"]) == in_memory


def test_a_rerun_evaluates_nothing_again(tiny: dict[str, Path], evaluated: dict[str, Any]) -> None:
    proc = _eval(tiny, tiny["run"], "--merge", "sma:4", "--tasks", TASKS, "--limit", "24", "--noise", "2",
                 "-o", evaluated["out"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "evaluating" not in proc.stderr
    assert _rows(evaluated["out"]) == evaluated["rows"]


def test_a_killed_eval_resumes_where_it_stopped(tiny: dict[str, Path]) -> None:
    out = tiny["root"] / "killed.jsonl"
    args = ["eval", tiny["run"], "--merge", "sma:3", "--merge", "wma:3", "--tasks", TASKS, "--limit", "12",
            "--noise", "2", "-o", out]  # fmt: skip
    env = cli_env(**tiny["env"])  # type: ignore[dict-item]
    proc = subprocess.Popen([sys.executable, "-m", "pmakit", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not (out.is_file() and len(out.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
            assert proc.poll() is None, "finished before it could be killed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    with open(out, "a") as f:
        f.write('{"target": "torn')  # what a kill in the middle of a write leaves
    before = len(_finished(read_jsonl(out)))
    again = _eval(tiny, *args[1:])
    assert again.returncode == 0, again.stderr[-3000:]
    # 4 models (sma:3, wma:3, latest, back:1) x 2 tasks, minus the finished ones
    assert again.stderr.count("evaluating") == 8 - before and before >= 1
    rows = read_jsonl(out)
    keys = [(r["recipe"], r["task"], r["metric"]) for r in rows]
    assert len(keys) == len(set(keys)) == 16


def test_report_on_an_eval_folder_shows_scores_paired_differences_and_the_noise_band(
    tiny: dict[str, Path], evaluated: dict[str, Any]
) -> None:
    """`pmakit eval -o DIR --reference back:1` then `pmakit report DIR`: the table's numbers are the rows' own,
    paired by hand through pmakit.eval.stats."""
    folder = tiny["root"] / "report-folder"
    again = _eval(tiny, tiny["run"], "--merge", "sma:4", "--tasks", TASKS, "--limit", "24", "--noise", "2",
                  "--reference", "back:1", "-o", folder)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (folder / "evals.jsonl").is_file() and "evaluating" in again.stderr
    proc = run_cli("report", folder, env=tiny["env"])  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (folder / "report.md").read_text()
    assert (folder / "report.html").is_file() and "Downstream evaluation (pmakit eval)" in md
    rows = _rows(folder / "evals.jsonl")
    row = {(r["recipe"], r["metric"]): r for r in rows if r["task"] == "pmakit_bpb"}
    sma, latest, back = (row[(k, "bits_per_byte")] for k in ("sma:4", "latest", "back:1"))
    value, se = stats.score("bits_per_byte", sma["items"])
    vs_latest = stats.paired("bits_per_byte", *stats.aligned(sma, latest))
    vs_ref = stats.paired("bits_per_byte", *stats.aligned(sma, back))
    band = stats.noise_band([latest["value"], back["value"]])
    (line,) = [x for x in md.splitlines() if x.startswith("| sma:4 |") and f"{value:.4f} ± {se:.4f}" in x]
    assert f"{vs_latest.delta:+.4f} ± {vs_latest.se:.4f}" in line
    assert f"[{vs_latest.low:+.4f}, {vs_latest.high:+.4f}]" in line
    assert f"{vs_ref.delta:+.4f} ± {vs_ref.se:.4f}" in line and "reference `back:1`" in md
    assert f"noise sd {band['sd']:.4f} over the 2 newest raw snapshots" in md
    assert "sma:4" in proc.stdout and "Δ vs latest" in proc.stdout


# --- known answers


def test_a_uniform_model_scores_the_tasks_exact_chance(tiny: dict[str, Path]) -> None:
    from safetensors.torch import load_file, save_file

    newest = gather([tiny["run"]])[0][-1].path
    uniform = tiny["root"] / "uniform"
    uniform.mkdir()
    for f in newest.iterdir():
        if f.name != "pmakit.json":
            (uniform / f.name).write_bytes(f.read_bytes())
    state = load_file(newest / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, uniform / "model.safetensors")
    out = tiny["root"] / "uniform.jsonl"
    proc = _eval(tiny, uniform, "--tasks", "pmakit_next_line", "--corpus-of", tiny["run"], "-o", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["metric"]: r for r in _rows(out)}
    info = rows["acc"]["task_info"]
    assert rows["acc"]["items_n"] == info["items"] >= 100
    assert (
        rows["acc"]["value"] == info["uniform_acc"] and rows["acc_norm"]["value"] == info["uniform_acc_norm"]
    )


def _choice_task(folder: Path, items: list[dict[str, Any]]) -> None:
    from pmakit.eval.tasks import choice_task_yaml

    folder.mkdir()
    (folder / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    (folder / "peaked_choice.yaml").write_text(choice_task_yaml("peaked_choice", folder / "data.jsonl"))


def test_a_model_with_all_its_mass_on_the_answer_scores_100_percent(tiny: dict[str, Path]) -> None:
    """A Llama whose every layer adds nothing and whose head puts e^320 : 1 on token T, on items whose right
    continuation is T repeated."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    newest = gather([tiny["run"]])[0][-1].path
    tok = AutoTokenizer.from_pretrained(newest)
    letter = next(c for c in "qzjkQZJKVW" if len(set(tok(c * 4, add_special_tokens=False)["input_ids"])) == 1
                  and len(tok(c * 4, add_special_tokens=False)["input_ids"]) == 4)  # fmt: skip
    (target,) = set(tok(letter, add_special_tokens=False)["input_ids"])
    config = AutoConfig.from_pretrained(newest)
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                p.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight[target] = 10.0
    folder = tiny["root"] / "peaked"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    others = [c for c in "abcdefgh" if c != letter]
    items = [{"context": f"v{i} =", "choices": [letter * (2 + i % 3) if j == i % 4 else others[(i + j) % 7] * (2 + j)
                                                for j in range(4)], "label": i % 4} for i in range(8)]  # fmt: skip
    _choice_task(tiny["root"] / "peaked-task", items)
    out = tiny["root"] / "peaked.jsonl"
    proc = _eval(
        tiny, folder, "--tasks", "peaked_choice", "--include", tiny["root"] / "peaked-task", "-o", out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["metric"]: r["value"] for r in _rows(out)} == {"acc": 1.0, "acc_norm": 1.0}


def test_a_continuation_longer_than_an_moe_models_context_is_scored_in_windows(tiny: dict[str, Path]) -> None:
    """lm-eval's HFLM asserts that a continuation fits the model's context (an 8-token OLMoE here, the MoE smoke
    preset's was 64); the bridge scores it in windows, equal to the log-probabilities taken from the model by hand,
    and a request that fits is lm-eval's own number."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from pmakit.eval.lm import WindowedHFLM
    from pmakit.train.model import ModelConfig, build_model

    tok = AutoTokenizer.from_pretrained(gather([tiny["run"]])[0][-1].path)
    cfg = ModelConfig(layers=1, hidden=32, heads=2, seq_len=8, experts=4, top_k=2, expert_width=16)
    model = build_model(cfg, 300, seed=3).eval()
    ours = WindowedHFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4)
    plain = HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=4)
    assert ours.max_length == plain.max_length == 8
    context, continuation = list(range(5, 17)), list(range(20, 40))  # 20 tokens, 3 windows of at most 8
    short, long = (("a", "b"), context, continuation[:6]), (("c", "d"), context, continuation)
    with pytest.raises(AssertionError):
        plain._loglikelihood_tokens([long])
    assert ours._loglikelihood_tokens([short]) == plain._loglikelihood_tokens([short])
    (ll, greedy), (ll_short, _) = ours._loglikelihood_tokens([long, short])
    seq, expected = context + continuation, 0.0
    with torch.no_grad():
        for start in (0, 8, 16):  # each window predicts its tokens from the 8 tokens before its last one
            end = len(context) + min(start + 8, len(continuation))
            n = end - len(context) - start
            logp = model(torch.tensor([seq[:end][-9:-1]])).logits.log_softmax(-1)[0, -n:]
            expected += float(logp.gather(1, torch.tensor(seq[end - n : end])[:, None]).sum())
    assert ll == pytest.approx(expected, rel=1e-5) and not greedy
    assert ll_short == pytest.approx(plain._loglikelihood_tokens([short])[0][0], rel=1e-5)


def test_each_string_is_tokenized_once_per_tokenizer_and_scores_are_lm_evals(tiny: dict[str, Path]) -> None:
    """A study scores many models on the same requests: the second model's requests are not tokenized again, and
    the scores are lm-eval's own HFLM's to the last digit."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pmakit.eval import harness
    from pmakit.eval.tasks import build_tasks

    newest = gather([tiny["run"]])[0][-1].path
    tok = AutoTokenizer.from_pretrained(newest)
    model = AutoModelForCausalLM.from_pretrained(newest).eval()
    cache = next((tiny["root"] / "cache" / "corpus").glob("corpus-*"))
    manager = harness.task_manager([build_tasks(cache).include("test")], ("pmakit_next_line",))
    calls = []
    encode = tok.encode
    tok.encode = lambda *a, **k: calls.append(a[0]) or encode(*a, **k)  # type: ignore[method-assign]
    with torch.no_grad():
        first = harness.run_tasks(harness.hflm(model, tok, device=None), ["pmakit_next_line"], manager)
        encoded = len(calls)
        second = harness.run_tasks(harness.hflm(model, tok, device=None), ["pmakit_next_line"], manager)
        assert encoded > 100 and len(calls) == encoded  # nothing tokenized for the second model
        plain = harness.run_tasks(
            HFLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=8), ["pmakit_next_line"], manager
        )
    values = [{m: s.value for m, s in r["pmakit_next_line"].items()} for r in (first, second, plain)]
    assert values[0] == values[1] == values[2]


def test_a_task_set_built_before_gets_the_yamls_of_this_version_and_the_same_scores(
    tiny: dict[str, Path],
) -> None:
    """Task YAMLs once read their fields through Jinja templates ("{{context}}"), which lm-eval compiles again for
    every document; a cached task set written that way is given the field names, and scores the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pmakit.eval import harness
    from pmakit.eval.tasks import build_tasks

    newest = gather([tiny["run"]])[0][-1].path
    tok = AutoTokenizer.from_pretrained(newest)
    model = AutoModelForCausalLM.from_pretrained(newest).eval()
    cache = next((tiny["root"] / "cache" / "corpus").glob("corpus-*"))
    tasks = ("pmakit_next_line", "pmakit_bpb")

    def scores() -> dict[str, dict[str, float]]:
        taskset = build_tasks(cache)
        manager = harness.task_manager([taskset.include("test")], tasks)
        with torch.no_grad():
            out = harness.run_tasks(harness.hflm(model, tok, device=None), tasks, manager)
        return {t: {m: s.value for m, s in out[t].items()} for t in tasks}

    now = scores()
    folder = build_tasks(cache).root / "test"
    for name, old in (
        ("pmakit_next_line", 'doc_to_text: "{{context}}"'),
        ("pmakit_bpb", 'doc_to_target: "{{text}}"'),
    ):
        path = folder / f"{name}.yaml"
        text = path.read_text().replace("doc_to_text: context", old).replace("doc_to_target: text", old)
        path.write_text(text.replace("doc_to_choice: choices", 'doc_to_choice: "{{choices}}"'))
        assert "{{" in path.read_text()
    assert scores() == now
    assert not any("{{" in p.read_text() for p in folder.glob("*.yaml"))


def test_lm_evals_bars_are_off_during_its_run_and_back_after(
    tiny: dict[str, Path], capfd: Any, monkeypatch: Any
) -> None:
    """lm-eval draws tqdm bars per request pass and task build (one set per model and task in a study's
    downstream stage): none reach the output of a run; the environment is untouched and a bar after it draws."""
    from tqdm import tqdm

    from pmakit.eval import harness
    from pmakit.eval.model import load_folder, load_tokenizer
    from pmakit.eval.run import corpus_entry
    from pmakit.eval.tasks import build_tasks

    monkeypatch.setenv("PMAKIT_CACHE", tiny["env"]["PMAKIT_CACHE"])  # type: ignore[index]
    include = build_tasks(corpus_entry([tiny["run"]])).include("test")
    newest = gather([tiny["run"]])[0][-1].path
    lm = harness.hflm(load_folder(newest), load_tokenizer(newest))
    manager = harness.task_manager([include])
    environment = {
        k: v for k, v in os.environ.items() if k.startswith("TQDM")
    }  # (sklearn, imported by lm-eval,
    capfd.readouterr()  # sets KMP_DUPLICATE_LIB_OK on import)
    scores = harness.run_tasks(lm, ["pmakit_next_line"], manager, limit=8)
    printed = capfd.readouterr()
    assert len(scores["pmakit_next_line"]["acc"].items) == 8
    assert "it/s" not in printed.err + printed.out and "Running loglikelihood" not in printed.err
    assert {k: v for k, v in os.environ.items() if k.startswith("TQDM")} == environment
    for _ in tqdm(range(3), file=sys.stderr, disable=False, mininterval=0):
        pass
    assert "3/3" in capfd.readouterr().err


# --- mistakes


def _one_error(proc: subprocess.CompletedProcess[str], says: str) -> None:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-2000:]


def test_bad_inputs_are_one_error_line_and_write_nothing(
    tiny: dict[str, Path], make_run: Any, tmp_path: Path
) -> None:
    out = tmp_path / "evals.jsonl"
    _one_error(
        _eval(tiny, tiny["run"], "--tasks", "pmakit_nxt_line", "-o", out), "unknown task 'pmakit_nxt_line'"
    )
    _one_error(
        _eval(tiny, tiny["run"], "--merge", "sma:99", "--tasks", TASKS, "-o", out), "needs 99 snapshots"
    )
    _one_error(_eval(tiny, make_run(2), "--tasks", TASKS, "-o", out), "cannot build a model")
    fake = tmp_path / "no-lm-eval"
    (fake / "lm_eval").mkdir(parents=True)
    (fake / "lm_eval" / "__init__.py").write_text("raise ImportError('hidden for this test')\n")
    hidden = run_cli("eval", tiny["run"], "--tasks", TASKS, "-o", out,
                     env={**tiny["env"], "PYTHONPATH": f"{fake}{os.pathsep}{SRC}"})  # type: ignore[dict-item]  # fmt: skip
    _one_error(hidden, 'pip install -e ".[eval]"')
    assert not out.exists()


# --- in the training loop


def test_the_hf_callback_logs_the_merge_on_downstream_tasks(tiny: dict[str, Path], monkeypatch: Any) -> None:
    """The HF Trainer evaluates at steps 6 and 12; the callback scores the online merge on pmakit_next_line there:
    in the logs and metrics.jsonl, equal to the same tasks run on the averager's final merge."""
    import transformers

    from pmakit.eval.harness import LoopTasks
    from pmakit.eval.model import model_from_state
    from pmakit.eval.run import corpus_entry
    from pmakit.eval.tasks import build_tasks
    from pmakit.integrations.hf import PMACallback
    from pmakit.metrics import read_metrics

    monkeypatch.setenv("PMAKIT_CACHE", tiny["env"]["PMAKIT_CACHE"])  # type: ignore[index]
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    newest = gather([tiny["run"]])[0][-1].path
    include = build_tasks(corpus_entry([tiny["run"]])).include("test")
    ids = torch.randint(0, 300, (48, 32), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tiny["root"] / "hf"), max_steps=12, per_device_train_batch_size=4, learning_rate=3e-3,
        eval_strategy="steps", eval_steps=6, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        include_num_input_tokens_seen=True, seed=0,
    )  # fmt: skip
    tasks = LoopTasks(["pmakit_next_line"], newest, limit=8, include=[include])
    callback = PMACallback(tiny["root"] / "hf-snaps", 128, last=3, downstream=tasks)
    model = transformers.AutoModelForCausalLM.from_pretrained(newest)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[callback]
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "eval_merged/pmakit_next_line/acc" in h]
    assert [h["step"] for h in history] == [6, 12] and all("eval_merged_loss" in h for h in history)
    merged = [r for r in read_metrics(tiny["root"] / "hf-snaps") if r.get("model", "").startswith("merged")]
    assert [r["eval_merged/pmakit_next_line/acc_norm"] for r in merged] == [
        h["eval_merged/pmakit_next_line/acc_norm"] for h in history
    ]
    again = tasks.scores(model_from_state(newest, callback.averager.average()))
    assert again["eval_merged/pmakit_next_line/acc"] == history[-1]["eval_merged/pmakit_next_line/acc"]
    model.train()

    def seeded() -> None:
        torch.manual_seed(7), random.seed(7), np.random.seed(7)

    def draws() -> tuple[float, float, float]:
        return torch.rand(1).item(), random.random(), float(np.random.rand())

    seeded()
    tasks.scores(model)
    assert model.training  # scoring leaves the model in the mode the trainer had it in
    after = draws()
    seeded()
    assert (
        after == draws()
    )  # and the run's random streams where they were (simple_evaluate reseeds all three)


def test_tune_by_a_metric_chooses_on_selection_items_and_reports_on_test_items(tiny: dict[str, Path]) -> None:
    """Two trials (the baselines) and the learned weights over the best merge's window: each loss is minus the
    accuracy pmakit eval measures on that split's items."""
    proc = run_cli("tune", tiny["run"], "-o", tiny["root"] / "tuned", "--metric", "pmakit_next_line/acc",
                   "--budget-evals", "2", "-q", env=tiny["env"], timeout=1200)  # type: ignore[arg-type]  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tiny["root"] / "tuned" / "tune.json").read_text())
    assert (
        record["data"]["metric"] == "pmakit_next_line/acc" and "chosen by pmakit_next_line/acc" in proc.stdout
    )
    last = record["models"]["last"]
    for split in ("selection", "test"):
        out = tiny["root"] / f"acc-{split}.jsonl"
        done = _eval(
            tiny, tiny["run"], "--tasks", "pmakit_next_line", "--split", split, "--noise", "0", "-o", out
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert last[f"{split}_loss"] == pytest.approx(
            -_value(_rows(out), "latest", "pmakit_next_line", "acc"), abs=1e-12
        )
    # the learned-weights family: fitted on the held-out loss, scored by the metric on selection items
    (learned,) = [t for t in record["trials"] if t.get("learn")]
    assert record["learned"] == learned["learn"] and learned["learn"]["steps"] == 20
    assert learned["merge"]["family"] == "learned" and len(learned["merge"]["tokens"]) > 1
    recipe = tiny["root"] / "learned.json"
    recipe.write_text(json.dumps({"models": {"tuned": {"merge": learned["merge"]}}}))
    out = tiny["root"] / "learned-selection.jsonl"
    done = _eval(tiny, tiny["run"], "--merge", recipe, "--tasks", "pmakit_next_line", "--split", "selection",
                 "--noise", "0", "-o", out)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert learned["selection_loss"] == pytest.approx(
        -_value(_rows(out), str(recipe), "pmakit_next_line", "acc"), abs=1e-12
    )
