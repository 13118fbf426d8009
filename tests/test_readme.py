"""Every example in README.md and docs/*.md runs as written.

Each fenced block of the README and the docs pages is found here by its first line and has a recipe: the small
inputs it assumes (a run directory, snapshots, a Trainer), built in a scratch directory, and the words that stand
for them (``RUN_DIR``, ``SAVE_FOLDER``, ``SNAP1 SNAP2 SNAP3 ...``) replaced by their paths. Shell lines run through
the real ``pmakit`` entry point (``conftest.run_cli``: a process of its own) and ``torchrun``, Python blocks as
scripts, each in the scratch directory: every one must exit 0 without a traceback. Blocks are alternatives, so an
output directory a line names is removed before the line runs unless a later line of the same block reads it. A
block without a recipe fails the test, so an example cannot be added to any of these pages, or drift from the code,
without being run here. Not run here, each with its reason: ``make`` targets (``make test`` is this suite; ``make
demo`` and ``make bench`` have their own targets) and the long studies (``--preset spike``, ``init``, ``scaling``:
their smoke presets run in tests/test_studies.py and test_scaling.py). tests/test_docs.py checks the front page's
shape and that every link between the pages resolves.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import cli_env, run_cli, state, write_snapshot

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_pages() -> list[Path]:
    """The front page and every docs page, whose command blocks this test runs."""
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str
    """The page, relative to the repository root (``README.md``, ``docs/merging.md``)."""
    line: int
    """Line of the opening fence in the page."""
    lang: str
    text: str

    @property
    def key(self) -> str:
        return self.text.strip().splitlines()[0].strip()


def readme_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md, in page order."""
    blocks = []
    for page in doc_pages():
        lines, i = page.read_text().splitlines(), 0
        while i < len(lines):
            if lines[i].startswith("```"):
                start, lang = i, lines[i][3:].strip()
                i += 1
                body = []
                while not lines[i].startswith("```"):
                    body.append(lines[i])
                    i += 1
                blocks.append(Block(str(page.relative_to(ROOT)), start + 1, lang, "\n".join(body) + "\n"))
            i += 1
    return blocks


# ---------------------------------------------------------------------------------------------- inputs


def big_run(root: Path) -> Path:
    """RUN_DIR for the merge examples: 130 tiny snapshots 1B tokens apart (so --every 2B and --until 120B mean
    what they say), with config.json."""
    run = root / "RUN_DIR"
    if not run.exists():
        for i in range(1, 131):
            write_snapshot(run / f"step-{i * 1000:07d}", state(i), step=i * 1000, tokens=i * 1_000_000_000)
    return run


def spike_run(root: Path) -> Path:
    """RUN_DIR for the recovery examples: snapshots every 10M tokens to 200M, a loss spike at 150M in
    metrics.jsonl, optimizer state in the snapshot at 110M."""
    run = root / "spike-run"
    if run.exists():
        return run
    tps = 1_000_000  # tokens per step
    for i in range(1, 21):
        tokens = i * 10_000_000
        write_snapshot(
            run / "snapshots" / f"step-{tokens // tps:06d}", state(i), step=tokens // tps, tokens=tokens
        )
    import torch

    torch.save({"state": {}, "param_groups": []}, run / "snapshots" / "step-000110" / "optimizer.pt")
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(201):
            loss = 6.0 / (1 + step / 20) + 0.01 * ((step * 7919) % 13) / 13 + (3.0 if step >= 150 else 0.0)
            f.write(json.dumps({"kind": "train", "step": step, "tokens": step * tps, "loss": loss}) + "\n")
    return run


def copy_snapshots(src: Path, dst_names: list[str], root: Path) -> list[Path]:
    out = []
    for name, snap in zip(dst_names, sorted(p for p in src.iterdir() if p.is_dir())):
        if not (root / name).exists():
            shutil.copytree(snap, root / name)
        out.append(root / name)
    return out


# ---------------------------------------------------------------------------------------------- running


def run_python(code: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    script = cwd / f"readme_example_{abs(hash(code)) % 10**8}.py"
    script.write_text(code)
    env = cli_env()
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def shell_lines(text: str) -> list[str]:
    """The commands of a shell block: comments stripped, blank lines dropped."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def argv(line: str) -> list[str]:
    words = shlex.split(line)
    if words[0] == "pmakit":
        return [sys.executable, "-m", "pmakit", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    raise AssertionError(f"shell line of a docs block does not start with pmakit or torchrun: {line}")


def output_of(words: list[str]) -> str | None:
    for flag in ("-o", "--output"):
        if flag in words:
            return words[words.index(flag) + 1]
    return None


def run_shell_block(
    text: str, cwd: Path, subs: dict[str, str], timeout: float = 1800, resume: frozenset[str] = frozenset()
) -> None:
    """Run each line; an output named in ``resume`` is kept (the line resumes a run copied in), others removed."""
    for line in shell_lines(text):
        for word, path in subs.items():
            line = line.replace(word, path)
        words = argv(line)
        out = output_of(words)
        if out and (cwd / out).exists() and out not in resume:
            shutil.rmtree(cwd / out)  # the lines are alternatives: each writes its own fresh output
        # the entry point's code, forked from the suite's launcher (run_cli)
        if words[1:3] == ["-m", "pmakit"]:
            proc = run_cli(*words[3:], cwd=cwd, env={"COLUMNS": "100"}, timeout=timeout)
        else:
            proc = subprocess.run(
                words, cwd=cwd, env=cli_env(COLUMNS="100"), capture_output=True, text=True, timeout=timeout
            )
        assert proc.returncode == 0, f"docs example `{line}` exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        if out:
            assert (cwd / out).exists(), f"docs example `{line}` wrote no {out}"


# ---------------------------------------------------------------------------------------------- recipes

TINY_LLAMA = """
import torch, transformers
torch.manual_seed(0)
_config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
model = transformers.LlamaForCausalLM(_config)
"""

PRELUDES = {
    # the plain loop: 130 steps of 32768 tokens cross 2M tokens twice, so two snapshots join the average
    "from pmakit.online import OnlineAverager": TINY_LLAMA
    + """
model.config.save_pretrained(".")  # the config.json the example copies into each snapshot
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
_g = torch.Generator().manual_seed(0)
batches = ({"input_ids": (_x := torch.randint(0, 64, (256, 128), generator=_g)), "labels": _x} for _ in range(130))
def evaluate(model):
    with torch.no_grad():
        _x = torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(1))
        return model(input_ids=_x, labels=_x).loss.item()
""",
    "from pmakit.integrations.hf import PMACallback": TINY_LLAMA
    + """
import lightning
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir="hf-out", report_to=[], use_cpu=True, max_steps=1)
train = val = [{"input_ids": (_x := torch.randint(0, 64, (16,))), "labels": _x} for _ in range(4)]
""",
    "from pmakit.integrations.olmo_core import PMACallback": """
from olmo_core.train import TrainerConfig
trainer_config = TrainerConfig(save_folder="runs/x")
""",
}
POSTLUDES = {
    "from pmakit.online import OnlineAverager": """
from pathlib import Path
assert len(list(Path("run/snapshots").glob("step-*"))) == 2, list(Path("run/snapshots").iterdir())
assert averager.count == 2 and isinstance(merged_loss, float)
""",
    "from pmakit.integrations.hf import PMACallback": """
assert isinstance(trainer, lightning.Trainer) and isinstance(pma, type(pma))
""",
    "from pmakit.integrations.olmo_core import PMACallback": """
assert type(trainer_config.callbacks["pma"]).__name__ == "PMACallback"
""",
    "import json": """
assert json.load(open("llama70b.json"))
""",
    "from pmakit.config import load": """
from pmakit.snapshot import discover
assert len(discover("runs/x")) > 2
""",
}


@dataclass
class Recipe:
    setup: Callable[[Path], dict[str, str]] = field(default=lambda root: {})
    """Builds the block's inputs under the scratch directory; returns the page's words -> paths."""
    skip: str | None = None
    """Why the block is not run by this test."""


def _merge_examples(root: Path) -> dict[str, str]:
    run = big_run(root)
    copy_snapshots(run, ["ckpt-a", "ckpt-b", "ckpt-c"], root)
    return {}


def _merge_at_scale(root: Path) -> dict[str, str]:
    big_run(root)
    (layout_block,) = [b for b in readme_blocks() if b.key == "import json"]
    proc = run_python(layout_block.text, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {}


def _recover(root: Path) -> dict[str, str]:
    return {"RUN_DIR": str(spike_run(root))}


def _scaling_fit(root: Path) -> dict[str, str]:
    run = root / "runs" / "s-smoke"
    if not (run / "results.csv").exists():
        raise AssertionError("the scaling-smoke line of the same block runs first")
    shutil.copy(run / "results.csv", root / "results.csv")
    # the study's experiment.json beside it: the fit then takes the study's own bootstrap count (the smoke
    # preset's 20), not the 400 refits of a results file without one (the same code, 20x its time)
    shutil.copy(run / "experiment.json", root / "experiment.json")
    return {"[more.jsonl ...]": ""}


def _analyze(root: Path, smoke_run: Path) -> dict[str, str]:
    demo = root / "runs" / "demo"
    if not demo.exists():
        shutil.copytree(smoke_run, demo, ignore=shutil.ignore_patterns("anneal-*", "plots"))
    snaps = sorted((demo / "main" / "snapshots").glob("step-*"))[-3:]
    (root / "text.txt").write_text(Path(shutil.__file__).read_text() + Path(argparse.__file__).read_text())
    return {"RUN_DIR": str(demo), "SNAP1 SNAP2 SNAP3 ...": " ".join(map(str, snaps))}


def _tune(root: Path, smoke_run: Path) -> dict[str, str]:
    """runs/demo (the smoke study), a token file, two text files and an eval command for the tune block."""
    import numpy as np

    _analyze(root, smoke_run)
    np.save(root / "tokens.npy", np.random.default_rng(0).integers(0, 512, 40_000))
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "a.txt").write_text(Path(shutil.__file__).read_text())
    (root / "docs" / "b.txt").write_text(Path(argparse.__file__).read_text())
    (root / "my_eval.py").write_text(  # a stand-in for a real harness: any command that prints a loss
        "import os, sys\nprint('loss', os.path.getsize(os.path.join(sys.argv[1], 'model.safetensors')) / 1e9)\n"
    )
    return {}


LONG = "a study of several minutes; its smoke preset runs in tests/test_studies.py / test_scaling.py / test_sweep.py"
SWEEP_BLOCK = (
    "pmakit experiment --preset sweep-smoke -o runs/sweep-smoke    # 4 toy candidates, under a minute"
)
EVAL = (
    'pmakit eval, tune/sweep-rank --metric and model="pmakit" run on a tiny trained run in tests/test_eval.py'
)
RECIPES: dict[str, Recipe] = {
    "make demo    # the main job: train a small model on real text, merge its snapshots, write a report": Recipe(
        skip="set-up commands: `make test` is this suite, `make demo` the main job (its own target)"
    ),
    "pmakit merge RUN_DIR -o merged/                       # SMA of the last 10 snapshots": Recipe(
        _merge_examples
    ),
    "pmakit merge RUN_DIR -o merged/ --format dcp                    # write torch DCP instead of HF safetensors": (
        Recipe(_merge_at_scale)
    ),
    "import json": Recipe(),
    "pmakit inspect SAVE_FOLDER                  # layout, step, tokens of every checkpoint; optimizer entries skipped": (
        Recipe(skip="run on the frameworks' own save folders in tests/layouts/test_readme_layouts.py")
    ),
    "from pmakit.integrations.olmo_core import PMACallback": Recipe(),
    'state = dist_checkpointing.load({"model": model.sharded_state_dict()}, OUT)': Recipe(
        skip="megatron-core's own load in tests/layouts/megatron_run.py (load) runs these two lines, on 0.16 and 0.19"
    ),
    "from torchtitan.config import ConfigManager": Recipe(
        skip="torchtitan's own Trainer runs this recipe in tests/layouts/test_torchtitan.py (torchtitan_run.py online)"
    ),
    "from pmakit.online import OnlineAverager                            # pmakit before torch: see below": Recipe(),
    'from pmakit.integrations.hf import PMACallback          # pip install -e ".[hf]"; before torch, as above': Recipe(),
    "pmakit train --preset replicas-smoke -o runs/copies --replicas 2 --sync-every 4                  # local SGD, H = 4": (
        Recipe()
    ),
    "pmakit recover RUN_DIR -o recovered/                   # find the spike in RUN_DIR/metrics.jsonl, SMA of the last 3 before it": (
        Recipe(_recover)
    ),
    "from pmakit.config import load": Recipe(),
    "pmakit experiment --preset spike -o runs/spike   # E10: LR x40 burst -> spike; resume from latest vs SMA of 3, optimizer reset/kept": (
        Recipe(skip=LONG)
    ),
    "pmakit experiment --preset scaling -o runs/scaling        # 5 sizes x 4 budgets: trunks, merges, anneals, fits, report": (
        Recipe(_scaling_fit, skip=None)
    ),
    SWEEP_BLOCK: Recipe(skip=None),
    "pmakit analyze runs/demo -o analysis/                  # the experiment's best SMA window at its last fork": (
        Recipe()
    ),
    "pmakit tune runs/demo -o tuned/ --budget-evals 12                      # the run's own held-out split (corpus cache)": (
        Recipe()
    ),
    'pip install -e ".[eval]"                                        # lm-eval[hf]==0.4.13 (make test installs it)': (
        Recipe(skip=EVAL)
    ),
    "import lm_eval": Recipe(skip=EVAL),
    "┃ target ┃ model  ┃ task/metric                        ┃    score ± s.e. ┃ Δ vs latest ± s.e. ┃       95% interval ┃ noise sd (K) ┃": (
        Recipe(skip="a table pmakit eval prints, not a command")
    ),
    "pmakit inspect s3://bucket/runs/olmo-7b                        # layout, step, tokens of every checkpoint there": (
        Recipe(
            skip="needs an S3 endpoint: tests/test_remote.py runs these commands against a local S3 server"
        )
    ),
    "import pmakit": Recipe(
        skip="needs an S3 endpoint: tests/test_storage_api.py runs these calls against a local S3 server"
    ),
    "Error: s3://no-such-bucket/run: checking the bucket failed (no such bucket)": Recipe(
        skip="error messages, not commands: tests/test_remote.py checks each"
    ),
    "make bench          # merge: pmakit vs the I/O floor (cat), a naive load-all average and mergekit 0.1.5, warm and cold": (
        Recipe(skip="benchmarks: `make bench` is its own target, with ratios measured in the same run")
    ),
}
SKIPPED_LINES = {
    "pmakit experiment --preset scaling -o runs/scaling": LONG,
    "pmakit experiment --preset sweep -o runs/sweep": LONG,
}


def test_every_readme_block_has_a_recipe() -> None:
    keys = [b.key for b in readme_blocks()]
    missing = [f"{b.page}:{b.line}: {b.key}" for b in readme_blocks() if b.key not in RECIPES]
    assert not missing, "blocks with no recipe in tests/test_readme.py:\n" + "\n".join(missing)
    stale = [k for k in RECIPES if k not in keys]
    assert not stale, f"recipes for blocks no page has any more: {stale}"
    twice = {k for k in keys if keys.count(k) > 1}
    assert not twice, f"blocks that open with the same line (one recipe cannot tell them apart): {twice}"


_SCRATCH: list[Path] = []


@pytest.fixture
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One scratch directory per test process, shared by the blocks it runs (their inputs are built once, when
    missing). Not a module fixture on purpose: that would tie every block to one xdist worker; the blocks are
    independent, so they spread over both, and only those that read a study run share its worker."""
    if not _SCRATCH:
        _SCRATCH.append(tmp_path_factory.mktemp("readme"))
    return _SCRATCH[0]


def _shared_study(block: Block) -> tuple[str, ...]:
    """The session study runs a block reads (its tests run in their fixtures' worker)."""
    if block.key.startswith(("pmakit analyze", "pmakit tune")):
        return ("smoke_experiment",)
    if block.key.startswith("pmakit experiment --preset scaling"):
        return ("scaling_smoke",)
    if block.key == SWEEP_BLOCK:
        return ("sweep_smoke",)
    return ()


def _blocks_to_run() -> list[object]:
    return [
        pytest.param(b, marks=[pytest.mark.shares(*_shared_study(b))] if _shared_study(b) else [])
        for b in readme_blocks()
        if b.key in RECIPES and RECIPES[b.key].skip is None
    ]


@pytest.mark.parametrize("block", _blocks_to_run(), ids=lambda b: f"{Path(b.page).stem}-line{b.line}")
def test_readme_example_runs_as_written(block: Block, scratch: Path, request: pytest.FixtureRequest) -> None:
    recipe = RECIPES[block.key]
    if block.key.startswith("pmakit analyze"):
        subs = _analyze(scratch, request.getfixturevalue("smoke_experiment")[0])
    elif block.key.startswith("pmakit tune"):
        subs = _tune(scratch, request.getfixturevalue("smoke_experiment")[0])
    elif block.key == SWEEP_BLOCK:
        # the suite's own sweep-smoke study (tests/test_sweep.py) copied in: the line resumes it, as written
        if not (scratch / "runs" / "sweep-smoke").exists():
            shutil.copytree(request.getfixturevalue("sweep_smoke"), scratch / "runs" / "sweep-smoke")
        text = "\n".join(
            x for x in block.text.splitlines() if not any(x.startswith(s) for s in SKIPPED_LINES)
        )
        run_shell_block(text, scratch, {}, resume=frozenset({"runs/sweep-smoke"}))
        return
    elif not block.key.startswith("pmakit experiment --preset scaling"):
        subs = recipe.setup(scratch)
    if block.lang == "python":
        code = PRELUDES.get(block.key.split("  ")[0], "") + block.text
        code += POSTLUDES.get(block.key.split("  ")[0], "")
        proc = run_python(code, scratch)
        assert proc.returncode == 0, f"{block.page}, block at line {block.line}:\n{proc.stderr[-3000:]}"
        return
    text = "\n".join(
        line for line in block.text.splitlines() if not any(line.startswith(s) for s in SKIPPED_LINES)
    )
    if block.key.startswith("pmakit experiment --preset scaling"):
        # scaling-smoke first (the fit reads its results), then the fit
        lines = shell_lines(text)
        # The suite's own scaling-smoke study (tests/test_scaling.py) is copied in, so the docs line resumes it:
        # the command runs as written, the study is not trained twice.
        done = request.getfixturevalue("scaling_smoke")[0]
        if not (scratch / "runs" / "s-smoke").exists():
            shutil.copytree(done, scratch / "runs" / "s-smoke")
        smoke = "\n".join(x for x in lines if "scaling-smoke" in x)
        run_shell_block(smoke, scratch, {}, resume=frozenset({"runs/s-smoke"}))
        subs = recipe.setup(scratch)
        text = "\n".join(x for x in lines if "scaling-smoke" not in x)
    run_shell_block(text, scratch, subs)
