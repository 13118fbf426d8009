"""OLMo-core save folders written by OLMo-core's own Trainer + CheckpointerCallback (CPU, gloo, world size 1 and FSDP
over 2 ranks): merged with no token flags, checked against OLMo-core's own reader, loaded back by OLMo-core's
Trainer, which takes a training step from the merge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import run_cli
from layouts.conftest import HERE, SRC, run_framework
from pmakit.cli import cli
from pmakit.layouts import layout_of
from pmakit.snapshot import discover

olmo_ckpt = pytest.importorskip("olmo_core.distributed.checkpoint")


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of one checkpoint, unsharded by OLMo-core's own reader (the reference)."""
    metadata = olmo_ckpt.get_checkpoint_metadata(checkpoint / "model_and_optim")
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    values = olmo_ckpt.load_keys(checkpoint / "model_and_optim", keys)
    return {k.removeprefix("model."): v for k, v in zip(keys, values)}


def hand_average(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    states = [model_weights(c) for c in checkpoints]
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[-1]}


def test_save_folder_is_read_from_olmo_cores_own_metadata(olmo_core_runs: dict[str, Path]) -> None:
    from pmakit.layouts import open_weights

    snaps = discover(olmo_core_runs["ws1"])
    # step0 .. step10; OLMo-core's own step3-merged is not a snapshot.
    assert [s.path.name for s in snaps] == [f"step{i}" for i in range(11)]
    assert [s.tokens for s in snaps] == [64 * i for i in range(11)]  # 4 sequences x 16 tokens per step
    assert {(s.layout, s.source) for s in snaps} == {("olmo-core", "olmo-core")}
    assert (olmo_core_runs["ws1"] / "step3-merged").is_dir()
    # Every saved chunk (1 rank or FSDP's 2) is mapped from the .distcp file, not loaded into memory.
    for run in ("ws1", "ws2"):
        with open_weights(olmo_core_runs[run] / "step10") as reader:
            for name in reader.tensors:
                for _, _, box in reader._unit_boxes(name):  # type: ignore[attr-defined]
                    assert reader._mapped(name, box) is not None, (run, name)  # type: ignore[attr-defined]


def test_merge_with_no_token_flags_is_the_hand_average_and_olmo_core_loads_it(
    olmo_core_runs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "merged"
    proc = run_cli("merge", olmo_core_runs["ws1"], "-o", out, "-q")
    assert proc.returncode == 0, proc.stderr
    want = hand_average([olmo_core_runs["ws1"] / f"step{i}" for i in range(1, 11)])  # default: the last 10
    got = model_weights(out)  # OLMo-core's own reader: the keys are under model.
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)  # fp32 sum of w * x vs mean: ulps apart
    assert not any(
        k.startswith("optim.")
        for k in olmo_ckpt.get_checkpoint_metadata(out / "model_and_optim").state_dict_metadata
    )
    assert (out / ".metadata.json").is_file() and (out / "train" / "rank0.pt").is_file()
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert {i["layout"] for i in manifest["inputs"]} == {"olmo-core"} and manifest["produced_by"][
        "format"
    ] == "olmo-core"

    # OLMo-core's Trainer loads the merge (Trainer.load_checkpoint -> Checkpointer.load) and trains one step.
    save = tmp_path / "continued"
    run_framework(HERE / "olmo_core_run.py", "pma-init", out, save, tmp_path / "loaded.pt")
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    assert [p.name for p in save.iterdir() if p.name.startswith("step")] == ["step11"]
    assert discover(save)[-1].step == 11


def test_fsdp_two_rank_checkpoints_merge_like_unsharded_ones(
    olmo_core_runs: dict[str, Path], tmp_path: Path
) -> None:
    for run in ("ws1", "ws2"):
        r = CliRunner().invoke(
            cli, ["merge", str(olmo_core_runs[run]), "-o", str(tmp_path / run), "--last", "3"]
        )
        assert r.exit_code == 0, r.output
    assert len(list((olmo_core_runs["ws2"] / "step10" / "model_and_optim").glob("__1_*.distcp"))) > 0
    one, two = model_weights(tmp_path / "ws1"), model_weights(tmp_path / "ws2")
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_safetensors_on_request_keeps_olmo_core_names(
    olmo_core_runs: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    r = CliRunner().invoke(
        cli,
        [
            "merge",
            str(olmo_core_runs["ws1"]),
            "-o",
            str(tmp_path / "st"),
            "--last",
            "2",
            "--format",
            "safetensors",
        ],
    )
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "st" / "model.safetensors")
    want = hand_average([olmo_core_runs["ws1"] / "step9", olmo_core_runs["ws1"] / "step10"])
    assert got.keys() == want.keys() and "blocks.0.attention.w_q.weight" in got
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


def test_inspect_names_the_layout_and_fails_when_nothing_is_mergeable(
    olmo_core_runs: dict[str, Path], tmp_path: Path
) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(olmo_core_runs["ws1"]), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {row["layout"] for row in report["snapshots"]} == {"olmo-core"}
    assert report["model"]["tensors"] == 21  # model weights only: no optim.* entry
    assert all(any(s.startswith("optim.") for s in row["skipped_entries"]) for row in report["snapshots"])

    # A save that never finished (no .metadata.json, written last) is reported, not merged; nothing else: exit 1.
    partial = tmp_path / "save" / "step20"
    partial.mkdir(parents=True)
    (partial / "model_and_optim").mkdir()
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "save")])
    assert r.exit_code == 1
    assert "Error: nothing to merge" in r.stderr
    # Naming the weights directory instead of the checkpoint: a pointer to the checkpoint.
    r = CliRunner().invoke(
        cli, ["merge", str(olmo_core_runs["ws1"] / "step10" / "model_and_optim"), "-o", "x"]
    )
    assert r.exit_code == 1 and "name the checkpoint" in r.stderr and len(r.stderr.splitlines()) == 1
    assert layout_of(olmo_core_runs["ws1"] / "step3-merged") is None  # OLMo-core's own merge output


def test_metadata_is_read_without_olmo_core_installed(olmo_core_runs: dict[str, Path]) -> None:
    code = (
        "import sys; sys.modules['olmo_core'] = None\n"  # any import of olmo_core now fails
        "from pmakit.snapshot import discover; from pmakit.layouts import open_weights\n"
        f"s = discover({str(olmo_core_runs['ws2'])!r})[-1]\n"
        "r = open_weights(s.path); name = 'blocks.0.attention.w_q.weight'\n"
        "print(s.tokens, len(r.tensors), r.read(name, 0, 4).tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    tokens, count, head = proc.stdout.split(" ", 2)
    assert (int(tokens), int(count)) == (640, 21)
    want = model_weights(olmo_core_runs["ws1"] / "step10")["blocks.0.attention.w_q.weight"].reshape(-1)[:4]
    assert json.loads(head) == want.tolist()


def test_damaged_checkpoint_is_one_error_line(olmo_core_runs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    save = tmp_path / "save"
    for step in (9, 10):
        shutil.copytree(olmo_core_runs["ws1"] / f"step{step}", save / f"step{step}")
    for f in (save / "step10" / "model_and_optim").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated: DCP's reader fails inside a CheckpointException
    r = CliRunner().invoke(cli, ["merge", str(save), "-o", str(tmp_path / "out"), "--last", "2"])
    assert r.exit_code == 1, r.output
    assert "step10" in r.stderr and "truncated" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


# -- the online callback (pmakit.integrations.olmo_core.PMACallback) on OLMo-core's Trainer -----------------------


def evals(run: Path) -> dict[int, dict[str, object]]:
    records = [json.loads(line) for line in (run / "pma" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == "eval"}


@pytest.mark.parametrize("run", ["full", "ws2"])
def test_callback_snapshots_are_the_trainers_weights(
    olmo_core_callback_runs: dict[str, Path], run: str
) -> None:
    from safetensors.torch import load_file

    pma = olmo_core_callback_runs[run] / "pma"
    snaps = discover(pma)
    assert [(s.step, s.tokens) for s in snaps] == [
        (2, 128),
        (4, 256),
        (6, 384),
        (8, 512),
    ]  # every 2 x 64 tokens
    saved = load_file(pma / "step-00000008" / "model.safetensors")
    want = model_weights(olmo_core_callback_runs[run] / "save" / "step8")  # FSDP shards gathered for ws2
    assert saved.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(saved[name], value), name


def test_callback_evaluates_the_average_and_puts_the_weights_back(
    olmo_core_callback_runs: dict[str, Path], olmo_core_runs: dict[str, Path]
) -> None:
    records = evals(olmo_core_callback_runs["full"])
    assert {s: r["n"] for s, r in records.items()} == {
        2: 1,
        4: 2,
        6: 3,
        8: 3,
    }  # the evaluator runs every 2 steps
    assert all(isinstance(r["metrics"]["lm/val/CE loss"], float) for r in records.values())  # type: ignore[index]
    # Training went on from the trained weights: the same run without the callback has the same step-8 weights.
    with_cb = model_weights(olmo_core_callback_runs["full"] / "save" / "step8")
    without = model_weights(olmo_core_runs["ws1"] / "step8")
    for name, value in without.items():
        assert torch.equal(with_cb[name], value), name


def test_callback_resumes_the_interrupted_window(olmo_core_callback_runs: dict[str, Path]) -> None:
    """Killed after step 5, resumed from the step-4 checkpoint: the window [2, 4] is restored and completed at
    step 6, where OLMo-core's ModelMergeCallback would skip it; the merges match the uninterrupted run's."""
    full, resumed = evals(olmo_core_callback_runs["full"]), evals(olmo_core_callback_runs["resumed"])
    assert resumed[6]["n"] == 3
    for step in (6, 8):
        assert resumed[step]["metrics"] == full[step]["metrics"], step
    assert [s.step for s in discover(olmo_core_callback_runs["resumed"] / "pma")] == [2, 4, 6, 8]


def test_callback_scores_the_average_on_lm_eval_tasks(olmo_core_callback_runs: dict[str, Path]) -> None:
    """At each evaluation the average is scored on an lm-eval task (OLMo-core's Transformer seen by HFLM through
    CausalLMView): in metrics.jsonl and the trainer's own metrics, alike; at step 2 the average is the step-2
    snapshot alone and scores what its weights score in a fresh model outside the trainer; at step 8 the logged
    scores are those of `pmakit merge --last 3` of the snapshots (steps 4, 6, 8) in a fresh model, not the live
    weights'; a resumed run and the FSDP run over 2 ranks log the same scores."""
    keys = ("eval_merged/olmo_choice/acc", "eval_merged/olmo_choice/acc_norm")
    run = olmo_core_callback_runs["full"]
    logged = {s: {k: r[k] for k in keys} for s, r in evals(run).items()}
    assert sorted(logged) == [2, 4, 6, 8] and all(0 <= v <= 1 for x in logged.values() for v in x.values())
    lines = (run / "pma" / "trainer_metrics.jsonl").read_text().splitlines()
    assert {r["step"]: {k: r[k] for k in keys} for r in map(json.loads, lines)} == logged
    assert json.loads((run / "score-step2.json").read_text()) == logged[2]
    # at step 8 the window is steps 4, 6 and 8: the logged scores are those of their merge, not of the live weights
    average, live = (json.loads((run / f"score-{x}.json").read_text()) for x in ("avg8", "step8"))
    assert average == logged[8] and live != logged[8]
    resumed, ws2 = evals(olmo_core_callback_runs["resumed"]), evals(olmo_core_callback_runs["ws2"])
    assert all(resumed[s][k] == logged[s][k] for s in (6, 8) for k in keys)
    assert all(ws2[s][k] == logged[s][k] for s in logged for k in keys)
