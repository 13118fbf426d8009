"""The HF Trainer's own ``checkpoint-N`` folders with default ``TrainingArguments`` (the Trainer then records no
token count: ``num_input_tokens_seen`` stays 0): the error says what to do, and with ``--tokens-per-step`` the
step count gives the tokens; merged equal to the hand average, loaded back by ``from_pretrained``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from conftest import load_dir
from pmakit.cli import cli
from test_cli import assert_one_line_error

transformers = pytest.importorskip("transformers")

STEPS, SAVE_EVERY, BATCH, SEQ = 6, 2, 2, 8


@pytest.fixture(scope="module")
def trainer_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "trainer"
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    # The defaults but for what a CPU test must set: where, how long, how often to save.
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(config),
        args=args,
        train_dataset=[{"input_ids": x, "labels": x} for x in ids],
    )
    trainer.train()
    trainer.save_model()  # as the Trainer's examples end: the final model beside the checkpoints
    assert trainer.state.num_input_tokens_seen == 0  # what the defaults leave
    return out


def one_error_line(r: Result) -> str:
    """The error line of a command refused as pmakit refuses input: exit code 1 from click's ``Error:`` (not an
    exception escaping, which CliRunner catches without printing a traceback), and the one-line form
    ``test_cli.assert_one_line_error`` checks, after pmakit's log lines."""
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.exception, r.output)
    assert "Traceback" not in r.output, r.output  # stdout and stderr
    return assert_one_line_error(r, logged=True)


def test_defaults_need_tokens_per_step_and_say_so(trainer_output: Path, tmp_path: Path) -> None:
    names = sorted(p.name for p in trainer_output.iterdir() if p.name.startswith("checkpoint-"))
    assert names == [f"checkpoint-{s}" for s in (2, 4, 6)]
    # The final model at the top level is the last checkpoint's weights (the Trainer saves at the last step): the
    # folder is the checkpoints' save folder, not one model.
    assert (trainer_output / "model.safetensors").is_file()
    final, last = load_dir(trainer_output), load_dir(trainer_output / names[-1])
    assert all(torch.equal(final[k], last[k]) for k in last)
    r = CliRunner().invoke(cli, ["merge", str(trainer_output), "-o", str(tmp_path / "out")])
    error = one_error_line(r)
    assert "pass --tokens-per-step N" in error, r.stderr
    assert "include_num_input_tokens_seen=True" in error and "pmakit.json" not in error, error
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(cli, ["inspect", str(trainer_output)])
    error = one_error_line(r)
    assert "pass --tokens-per-step N" in error and "pmakit.json" not in error, r.stderr

    r = CliRunner().invoke(
        cli,
        ["merge", str(trainer_output), "-o", str(tmp_path / "out"), "--tokens-per-step", str(BATCH * SEQ)],
    )
    assert r.exit_code == 0, r.output
    inputs = [trainer_output / n for n in names]
    states = [load_dir(p) for p in inputs]
    got = load_dir(tmp_path / "out")
    assert got.keys() == states[-1].keys()
    for k in got:
        want = torch.stack([s[k].double() for s in states]).mean(0)
        torch.testing.assert_close(got[k].double(), want, rtol=0, atol=1e-6)
    assert not torch.equal(got["model.norm.weight"], states[-1]["model.norm.weight"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.arange(SEQ).unsqueeze(0)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    assert [(i["step"], i["tokens"]) for i in manifest["inputs"]] == [(s, s * BATCH * SEQ) for s in (2, 4, 6)]
