"""The merge and inspect commands through the real entry point: results, and one-line errors for bad input."""

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import _launchers, cli_env, run_cli, state, write_snapshot
from pmakit.merge import partial_dir


def assert_one_line_error(proc: object, *fragments: str, logged: bool = False) -> str:
    """A refusal as pmakit refuses: a non-zero exit, no traceback, one ``Error:`` line (returned) and only indented
    details below it. ``proc``: a finished process or a CliRunner result; ``logged``: pmakit's own ``info:`` and
    ``warning:`` lines may come first (a command run in-process logs to the same stream)."""
    code = getattr(proc, "returncode", None)
    assert (proc.exit_code if code is None else code) != 0  # type: ignore[attr-defined]
    err = proc.stderr.strip()  # type: ignore[attr-defined]
    assert "Traceback" not in err, err
    lines = err.splitlines()
    at = 0
    while logged and at < len(lines) and lines[at].startswith(("info: ", "warning: ")):
        at += 1
    assert lines[at:] and lines[at].startswith("Error: "), err
    assert all(x.startswith("  ") for x in lines[at + 1 :]), err  # a list of details below it is indented
    for f in fragments:
        assert f in err, (f, err)
    return lines[at]


def test_merge_run_dir_defaults_and_manifest(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(12)
    proc = run_cli("merge", run, "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    # default: SMA of the last 10 -> steps 300..1200
    assert [i["step"] for i in manifest["inputs"]] == list(range(300, 1201, 100))
    assert manifest["weights"] == pytest.approx([0.1] * 10)
    assert manifest["method"] == "sma"
    assert "wrote" in proc.stdout


def test_merge_selection_flags(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(10)  # tokens 1000, 2000, ..., 10000
    proc = run_cli(
        "merge",
        run,
        "-o",
        tmp_path / "out",
        "--last",
        "3",
        "--every",
        "2K",
        "--until",
        "9.5K",
        "--method",
        "ema",
        "--alpha",
        "0.5",
        "--dtype",
        "fp32",
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    # window ends at 9000 (newest <= 9500), every 2000: [5000, 7000, 9000]
    assert [i["tokens"] for i in manifest["inputs"]] == [5000, 7000, 9000]
    assert manifest["weights"] == pytest.approx([0.25, 0.25, 0.5])
    assert manifest["dtype"] == "fp32"


def test_merge_takes_the_recipe_grammar_of_eval_and_tune(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """`pmakit merge RUN --recipe R` is the merge the options it stands for make (same inputs, weights, bytes);
    latest, back:K and a tune output pick what `pmakit eval --merge` picks."""
    run = make_run(10)  # tokens 1000, 2000, ..., 10000

    def merged(name: str, *args: str) -> dict[str, object]:
        proc = run_cli("merge", run, "-o", tmp_path / name, "--quiet", *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads((tmp_path / name / "pmakit-merge.json").read_text())

    for recipe, options in (("sma:3", ["--last", "3"]),
                            ("ema:0.5:3:every=2K:until=9.5K",
                             ["--last", "3", "--every", "2K", "--until", "9.5K", "--method", "ema", "--alpha", "0.5"]),
                            ("wsm:1-sqrt:4", ["--last", "4", "--method", "wsm-1sqrt"])):  # fmt: skip
        a, b = merged(f"r-{recipe}", "--recipe", recipe), merged(f"o-{recipe}", *options)
        assert a["inputs"] == b["inputs"] and a["weights"] == b["weights"] and a["recipe"] == recipe
        assert (tmp_path / f"r-{recipe}" / "model.safetensors").read_bytes() == (
            tmp_path / f"o-{recipe}" / "model.safetensors"
        ).read_bytes()
    latest, back = merged("latest", "--recipe", "latest"), merged("back", "--recipe", "back:2")
    assert [i["tokens"] for i in latest["inputs"]] == [10000] and latest["weights"] == [1.0]
    assert [i["tokens"] for i in back["inputs"]] == [8000]
    tune = tmp_path / "tuned"
    tune.mkdir()
    (tune / "tune.json").write_text(json.dumps({"models": {"tuned": {"merge": {"tokens": [3000, 5000],
                                                                              "weights": [0.25, 0.75]}}}}))  # fmt: skip
    tuned = merged("from-tune", "--recipe", str(tune))
    assert [i["tokens"] for i in tuned["inputs"]] == [3000, 5000] and tuned["weights"] == [0.25, 0.75]
    for args, says in ((["--recipe", "sma:x"], "cannot read the recipe 'sma:x'"),
                       (["--recipe", "sma:20"], "needs 20 snapshots; the run has 10"),
                       (["--recipe", "sma:3", "--last", "4"], "does not take --last"),
                       (["--recipe", "ema:0.5", "--alpha", "0.3"], "does not take --alpha")):  # fmt: skip
        assert_one_line_error(run_cli("merge", run, "-o", tmp_path / "bad", *args), says)
        assert not (tmp_path / "bad").exists()


def test_explicit_snapshots_all_used_and_custom_weights(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(12)
    picks = [run / f"step-{s:06d}" for s in (1200, 100, 500)]
    proc = run_cli("merge", *picks, "-o", tmp_path / "out", "--weights", "1,1,2")
    assert proc.returncode == 0, proc.stderr
    assert "warning: --weights sum to 4; normalised to sum 1" in proc.stderr
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    assert [i["step"] for i in manifest["inputs"]] == [100, 500, 1200]
    assert manifest["weights"] == [0.25, 0.25, 0.5]


def test_dry_run_writes_nothing(make_run: Callable[..., Path], tmp_path: Path) -> None:
    proc = run_cli("merge", make_run(3), "-o", tmp_path / "out", "--last", "2", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "2 snapshots" in proc.stdout and "work memory" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_merged_model_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    sds = []
    for i in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        d = tmp_path / "run" / f"step-{i}"
        model.save_pretrained(d)
        sds.append({k: v.clone() for k, v in model.state_dict().items()})
        (d / "pmakit.json").write_text(json.dumps({"step": i, "tokens": i * 100}))
    proc = run_cli(
        "merge", tmp_path / "run", "-o", tmp_path / "merged", "--last", "3", "--max-shard-size", "20KB"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, sum(sd[k] for sd in sds) / 3, rtol=1e-6, atol=1e-6)


def test_inspect_table_and_json(make_run: Callable[..., Path]) -> None:
    run = make_run(3)
    (run / "step-000400").mkdir()
    (run / "step-000400" / "model.safetensors").write_bytes(b"")
    proc = run_cli("inspect", run, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["complete"] for r in report["snapshots"]] == [True, True, True, False]
    assert report["compatible"] and report["model"]["tensors"] == len(state(1))
    assert len(report["merge"]["tokens"]) == 3  # a short run: the default window takes the 3 it has
    proc = run_cli("inspect", run, "--last", "2")
    assert proc.returncode == 0, proc.stderr
    assert (
        "compatible" in proc.stdout and "merge of 2 snapshots" in proc.stdout and "incomplete" in proc.stdout
    )


# -- every user mistake: one line, non-zero exit, nothing left behind -------------------------------------------


def test_error_missing_snapshot(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("merge", tmp_path / "nope", "-o", tmp_path / "out"), "no such snapshot")


def test_error_too_few_snapshots(make_run: Callable[..., Path], tmp_path: Path) -> None:
    # Without --last a short run merges what it has (tests/test_selection.py); an explicit --last is exact.
    proc = run_cli("merge", make_run(4), "-o", tmp_path / "out", "--last", "10")
    assert_one_line_error(proc, "--last 10", "only 4 exist")


def test_error_mismatched_shapes(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2)
    odd = state(1)
    odd["head.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    write_snapshot(run / "step-000100", odd, step=100, tokens=1000)
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--last", "2")
    assert_one_line_error(proc, "do not match", "head.weight", "[3, 3]")
    assert not (tmp_path / "out").exists()


def test_error_corrupt_file(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2)
    (run / "step-000200" / "model.safetensors").write_bytes(b"garbage!garbage!")
    assert_one_line_error(
        run_cli("merge", run, "-o", tmp_path / "out", "--last", "2"), "corrupt", "step-000200"
    )


def test_error_nan_weights(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(3)
    bad = state(3)
    bad["embed.weight"][0, 0] = float("nan")
    write_snapshot(run / "step-000300", bad, step=300, tokens=3000)
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--last", "3")
    assert_one_line_error(proc, "NaN", "embed.weight", "step-000300", "--exclude")
    assert not (tmp_path / "out").exists() and not partial_dir(tmp_path / "out").exists()
    # the user's way out: leave that snapshot out
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--last", "2", "--exclude", run / "step-000300")
    assert proc.returncode == 0, proc.stderr


def test_error_existing_output(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2)
    (tmp_path / "out").mkdir()
    assert_one_line_error(run_cli("merge", run, "-o", tmp_path / "out", "--last", "2"), "--force")
    assert run_cli("merge", run, "-o", tmp_path / "out", "--last", "2", "--force").returncode == 0


def test_error_bad_options(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(3)
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--last", "2", "--weights", "1,2,3")
    assert_one_line_error(proc, "3 weights for 2")
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--every", "4X")
    assert (
        proc.returncode == 2 and "cannot read token count" in proc.stderr and "Traceback" not in proc.stderr
    )
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--method", "lawa")
    assert proc.returncode == 2 and "sma" in proc.stderr


def test_error_explicit_incomplete_snapshot(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(2)
    (run / "step-000200" / "pmakit.json").unlink()
    proc = run_cli("merge", run / "step-000100", run / "step-000200", "-o", tmp_path / "out")
    assert_one_line_error(proc, "step-000200", "token count is unknown")


def test_inspect_of_a_long_run_fits_80_columns_and_shows_the_window(make_run: Callable[..., Path]) -> None:
    run = make_run(40)
    proc = run_cli("inspect", run, env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("40 complete snapshots (pmakit, safetensors")
    assert len(lines) < 30 and max(map(len, lines)) <= 80
    assert "step-004000" in proc.stdout and "step-003000" not in proc.stdout  # the last 10 only
    assert "step-003000" in run_cli("inspect", run, "--all", env={"COLUMNS": "80"}).stdout


def test_sigterm_while_the_command_is_leaving_prints_no_traceback() -> None:
    # torchrun and `pmakit train --replicas` stop the other copies with SIGTERM when one fails; a copy already past
    # its command (in the interpreter's exit hooks) must end with 143, not print a SystemExit traceback (a CI flake).
    code = (
        "import atexit, os, signal, sys\n"
        "atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))\n"
        "sys.argv = ['pmakit', 'merge', '--help']\n"
        "from pmakit._env import run_cli\n"
        "run_cli()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 143
    assert "Traceback" not in done.stderr, done.stderr
    assert "Usage: pmakit merge" in done.stdout  # what the command printed before the signal is kept


def test_a_study_directory_merges_its_main_run_or_names_the_runs_that_hold_snapshots(tmp_path: Path) -> None:
    study = tmp_path / "study"  # as `pmakit experiment -o study` lays it out
    for k in (1, 2, 3):
        write_snapshot(study / "main" / "snapshots" / f"step-{k}", state(k), step=k, tokens=100 * k)
        write_snapshot(study / "anneal-300" / "snapshots" / f"step-{k}", state(k), step=k, tokens=100 * k)
    merged = run_cli("merge", study, "-o", tmp_path / "m", "-q")
    assert merged.returncode == 0, merged.stderr
    assert f"{study} is a study: using its main run, {study / 'main'}" in merged.stderr
    inputs = json.loads((tmp_path / "m" / "pmakit-merge.json").read_text())["inputs"]
    assert [Path(i["path"]).parent.parent.name for i in inputs] == ["main"] * 3
    shown = run_cli("inspect", study)
    assert shown.returncode == 0 and "is a study" in shown.stderr and "step-3" in shown.stdout, shown.stderr
    # no main run: the runs under it are named, and inspect shows no empty table
    (study / "main").rename(study / "other")
    for command in (("merge", study, "-o", tmp_path / "m2"), ("inspect", study)):
        proc = run_cli(*command)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"runs with snapshots under it: {study / 'anneal-300'}, {study / 'other'}" in proc.stderr
        assert "snapshots, in" not in proc.stdout


def test_small_first_hour_answers(tmp_path: Path) -> None:
    # train --help names every shipped preset
    helped = " ".join(run_cli("train", "--help").stdout.split())
    assert "replicas-smoke" in helped and "scaling-smoke" in helped
    for k in (1, 2):
        write_snapshot(tmp_path / "run" / f"step-{k}", state(k, torch.float32), step=k, tokens=100 * k)
    # --alpha with a weighting it does nothing for: one line, no merge
    sma = run_cli("merge", tmp_path / "run", "-o", tmp_path / "a", "--alpha", "0.5")
    assert sma.returncode == 1
    assert [x for x in sma.stderr.splitlines() if not x.startswith("info: ")] == sma.stderr.splitlines()[-1:]
    assert sma.stderr.splitlines()[-1].startswith("Error: --alpha is the EMA factor"), sma.stderr
    assert not (tmp_path / "a").exists()
    # --keep-fp32 on an fp32 merge writes no pmakit-fp32/ and says why
    kept = run_cli("merge", tmp_path / "run", "-o", tmp_path / "k", "--keep-fp32", "-q")
    assert kept.returncode == 0, kept.stderr
    assert not (tmp_path / "k" / "pmakit-fp32").exists() and "the merge is fp32 already" in kept.stderr


def test_a_snapshot_interval_no_sync_fits_names_what_does() -> None:
    from pmakit.errors import PmakitError
    from pmakit.train.replicas import ReplicaConfig, check_sync_interval

    # the smoke preset with 2 copies: 10,240-token snapshots, 2 x 2,048 tokens a step: no H fits
    with pytest.raises(PmakitError, match=r"no --sync-every fits: .* multiple of 4,096 .*replicas-smoke"):
        check_sync_interval(ReplicaConfig(sync_every=1), 2, 10_240, 2_048)
    with pytest.raises(PmakitError, match=r"--sync-every 1, 2, 4 fit$"):
        check_sync_interval(ReplicaConfig(sync_every=3), 2, 16_384, 2_048)
    check_sync_interval(ReplicaConfig(sync_every=4), 2, 16_384, 2_048)


def _same_run(text: str, out: Path) -> str:
    """A command's output without what differs between two runs of it: the output's name, times and rates, the
    memory free."""
    text = re.sub(r"\d+(\.\d+)? [KMG]?i?B/s\b", "# B/s", text.replace(str(out), "OUT"))  # KiB/s or MiB/s
    return re.sub(r"\d+\.\d+ (s\b|GiB of memory)", r"# \1", text)


def test_the_suites_launcher_runs_a_command_as_a_fresh_interpreter_does(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_cli forks most commands from a launcher that loaded torch and the CLI once (tests/cli_launcher.py): what
    a command prints, writes and exits with must be what ``python -m pmakit`` in a new interpreter gives."""
    monkeypatch.delenv("PMAKIT_TESTS_FRESH", raising=False)  # (that would compare fresh with fresh)
    run = make_run(4)
    out = tmp_path / "out"
    cases = {
        "merge": ("merge", run, "--last", "2", "--dtype", "fp32", "-o", out),  # run twice: then refused
        "mistake": ("merge", tmp_path / "nothing-here", "-o", out),  # one Error line, exit 1
        "usage": ("inspect", run, "-o", out),  # click's usage error, exit 2
        "inspect": ("inspect", run),
    }
    got: dict[str, dict[str, list[Any]]] = {}
    for case, args in cases.items():
        words = [str(a) for a in args]
        assert _launchers()[0].takes(words, cli_env())
        got[case] = {}
        for how in ("launcher", "fresh"):
            shutil.rmtree(out, ignore_errors=True)
            procs = [run_cli(*words, fresh=how == "fresh") for _ in range(2)]
            got[case][how] = [
                (p.returncode, _same_run(p.stdout, out), _same_run(p.stderr, out)) for p in procs
            ]
            got[case][how].append(sorted((f.name, f.read_bytes()) for f in out.glob("*.safetensors")))
        assert got[case]["launcher"] == got[case]["fresh"], case
    assert [got[case]["fresh"][0][0] for case in cases] == [0, 1, 2, 0]
    # the second merge into the same output is refused; the first one's weights are there
    assert got["merge"]["fresh"][1][0] == 1 and got["merge"]["fresh"][2]
    assert got["mistake"]["fresh"][0][2].startswith("Error: ")


def test_a_training_command_from_the_launcher_trains_the_same_bits_as_a_fresh_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiment and train come from the launcher that pinned the kernels before it loaded torch
    (tests/cli_launcher.py): the snapshots, losses and output must be a fresh interpreter's, bit for bit."""
    monkeypatch.delenv("PMAKIT_TESTS_FRESH", raising=False)  # (that would compare fresh with fresh)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, module in enumerate((shutil, subprocess, json, re)):
        (corpus / f"m{i}.py").write_text(Path(module.__file__ or "").read_text())
    config = tmp_path / "c.yaml"
    config.write_text(
        f"preset: smoke\ntrain:\n  corpus: {corpus}\n  vocab_size: 300\n  val_fraction: 0.25\n"
        "  max_corpus_bytes: null\n  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}\n  batch_size: 4\n"
        "  total_tokens: 1024\n  warmup_tokens: 128\n  every_tokens: 256\n  eval_every: 2\n  eval_batches: 2\n"
    )
    env = {"PMAKIT_CACHE": str(tmp_path / "cache")}
    assert _launchers()[1].takes(["train"], cli_env(**env))
    got = {}
    for how in ("launcher", "fresh"):
        run = tmp_path / how
        proc = run_cli("train", config, "-o", run, env=env, fresh=how == "fresh")
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [{k: v for k, v in r.items() if "loss" in k or "norm" in k} for r in records]
        weights = sorted((str(f.relative_to(run)), f.read_bytes()) for f in run.rglob("*.safetensors"))
        got[how] = (_same_run(proc.stdout, run), losses, weights)
    assert len(got["fresh"][2]) >= 4 and any(got["fresh"][1])  # the snapshots and the checkpoint
    assert got["launcher"] == got["fresh"]
