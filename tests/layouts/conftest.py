"""Checkpoints written by the real frameworks' own trainers (CPU, gloo), once per test session."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


MCORE19 = Path(os.environ.get("PMAKIT_MCORE19", HERE.parents[1] / ".venv" / "mcore-0.19"))
"""megatron-core 0.19.2's code, unpacked by ``make test`` (see the Makefile): put first on PYTHONPATH, it is the
release the framework scripts import instead of the pinned 0.16.1."""
MCORE = {
    v: Path(os.environ.get(f"PMAKIT_MCORE{v[2:]}", HERE.parents[1] / ".venv" / f"mcore-{v}"))
    for v in ("0.17", "0.18")
}
"""megatron-core 0.17.1 and 0.18.2's code, unpacked beside 0.19 by ``make test``: their ``common.pt`` layout (0.19
keeps the common state inside the DCP files)."""
MCORE["0.19"] = MCORE19


def run_framework(
    script: Path,
    *args: str | Path,
    ranks: int = 1,
    timeout: float = 1800,
    path: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run a framework driver script (``torchrun`` for ``ranks > 1``), with ``path`` first on PYTHONPATH; fail
    the test with its output tail. ``timeout`` guards against a hang only.

    The drivers (``*_run.py``) turn the cyclic garbage collector off before the framework's imports, as torchtitan's
    and Megatron-LM's own manual-GC settings do: walking the objects torch and the framework create at import was
    ~20% of a 6-step Megatron run's CPU (7.8 -> 6.2 s, ``/usr/bin/time``) and ~6% of 5 torchtitan steps (9.2 ->
    8.7 s); what they compute is the same."""
    pythonpath = os.pathsep.join(map(str, (*path, SRC)))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    proc = subprocess.run(
        [*launcher, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{script.name} {' '.join(map(str, args))} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def olmo_core_all(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every OLMo-core run the tests need, in 4 processes (each start-up costs seconds of imports):

    - ``ws1``: 10 steps, a checkpoint every step, plus OLMo-core's own ``step3-merged``;
    - ``ws2``: the last 4 of them loaded and saved again by OLMo-core under FSDP over 2 ranks (same weights);
    - ``cb-full``, ``cb-resumed``, ``cb-ws2``: pmakit's PMACallback on the Trainer, 8 steps, uninterrupted; killed
      after step 5 (its last checkpoint is step 4) and resumed by the Trainer; under FSDP over 2 ranks. Each has
      ``save`` (OLMo-core's checkpoints) and ``pma`` (pmakit's snapshots and metrics.jsonl); ``cb-full`` also
      ``score-step2.json``, its step-2 snapshot scored on the callback's lm-eval task outside the trainer, and
      ``score-avg8.json`` / ``score-step8.json``: the same for ``pmakit merge --last 3`` of its snapshots at step 8
      (the callback's window then) and for the step-8 snapshot alone.
    """
    pytest.importorskip("olmo_core")
    root = tmp_path_factory.mktemp("olmo_core")
    script = HERE / "olmo_core_run.py"
    p = {name: root / name for name in ("ws1", "ws2", "cb-full", "cb-resumed", "cb-ws2")}
    run_framework(
        script,
        "train",
        p["ws1"] / "save",
        10,
        "+",
        "callback",
        p["cb-full"] / "save",
        p["cb-full"] / "pma",
        8,
        *(
            "+",
            "score",
            p["cb-full"] / "pma" / "step-00000002",
            root / "work",
            p["cb-full"] / "score-step2.json",
        ),
        # the step-8 merge of the callback's window (steps 4, 6, 8) by pmakit merge, and the step-8 weights alone
        *("+", "cli", "merge", p["cb-full"] / "pma", "--last", "3", "-o", root / "avg8", "-q"),
        *("+", "score", root / "avg8", root / "work", p["cb-full"] / "score-avg8.json"),
        *(
            "+",
            "score",
            p["cb-full"] / "pma" / "step-00000008",
            root / "work",
            p["cb-full"] / "score-step8.json",
        ),
    )
    run_framework(
        script,
        *("reshard", p["ws1"] / "save", p["ws2"] / "save", 4, "+"),
        *("callback", p["cb-ws2"] / "save", p["cb-ws2"] / "pma", 8),
        ranks=2,
    )
    resumed = (p["cb-resumed"] / "save", p["cb-resumed"] / "pma", "8")
    crashed = subprocess.run(
        [sys.executable, str(script), "callback", *map(str, resumed), "5"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(SRC)},
        timeout=1800,
    )
    assert crashed.returncode == 17, crashed.stderr[-3000:]  # the Crash callback's os._exit
    run_framework(script, "callback", *resumed)
    return p


@pytest.fixture(scope="session")
def olmo_core_runs(olmo_core_all: dict[str, Path]) -> dict[str, Path]:
    """OLMo-core save folders ``ws1`` and ``ws2`` (see ``olmo_core_all``)."""
    return {"ws1": olmo_core_all["ws1"] / "save", "ws2": olmo_core_all["ws2"] / "save"}


@pytest.fixture(scope="session")
def olmo_core_callback_runs(olmo_core_all: dict[str, Path]) -> dict[str, Path]:
    """PMACallback runs ``full``, ``resumed`` and ``ws2``, each with ``save`` and ``pma`` (see ``olmo_core_all``)."""
    return {
        "full": olmo_core_all["cb-full"],
        "resumed": olmo_core_all["cb-resumed"],
        "ws2": olmo_core_all["cb-ws2"],
    }


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Megatron-core torch_dist checkpoints and loads (``megatron_run.py``), in 2 framework processes:

    - ``ws1``: 6 iterations at TP=1, a checkpoint ``iter_000000N`` every iteration (model, optimizer, RNG, common);
    - ``merged``: ``pmakit merge ws1 -o merged`` through the real CLI, no token flags (the default window: all 6);
    - ``tp2``: the last 4 of ``ws1`` loaded by Megatron at TP=2 over 2 ranks and saved again (the same weights);
    - ``loaded-tp2``, ``loaded-tp1``: in that process, what Megatron loaded from ``merged`` at TP=2, then at TP=1
      (2 data-parallel replicas), saved again by Megatron. Each load then takes a training step and writes its
      JSON line to ``pma-init-tpN.json``.
    """
    for module in ("megatron", "psutil"):  # without psutil Megatron's torch_dist writer hangs
        if importlib.util.find_spec(module) is None:  # not imported here: the framework runs in subprocesses
            pytest.skip(f"{module} is not installed")
    from conftest import run_cli

    root = tmp_path_factory.mktemp("megatron")
    script = HERE / "megatron_run.py"
    p = {name: root / name for name in ("ws1", "merged", "tp2", "loaded-tp1", "loaded-tp2")}
    run_framework(script, "train", p["ws1"], 6)
    merge = run_cli("merge", p["ws1"], "-o", p["merged"], "-q")
    if merge.returncode != 0:
        pytest.fail(f"pmakit merge failed:\n{merge.stderr[-3000:]}")
    two = run_framework(
        script,
        *("reshard", p["ws1"], p["tp2"], 4, "+"),
        *("pma-init", p["merged"], p["loaded-tp2"], 2, "+", "pma-init", p["merged"], p["loaded-tp1"], 1),
        ranks=2,
    )
    for line in two.stdout.splitlines():
        if line.startswith('{"tp"'):
            (root / f"pma-init-tp{json.loads(line)['tp']}.json").write_text(line)
    return {**p, "root": root}


@pytest.fixture(scope="session")
def megatron19_one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The single-rank parts of ``megatron19_runs`` (``core``) and ``megatron_lm19_runs`` (``lm``, when the 0.19
    wheel's ``megatron.training`` is there) in one framework process: each start-up costs seconds of imports."""
    if not (MCORE19 / "megatron" / "core").is_dir():
        pytest.skip(f"megatron-core 0.19 is not unpacked at {MCORE19} (make test does it)")
    if importlib.util.find_spec("psutil") is None:
        pytest.skip("psutil is not installed (Megatron's torch_dist writer hangs without it)")
    core, lm = tmp_path_factory.mktemp("megatron19"), tmp_path_factory.mktemp("megatron-lm19")
    jobs: tuple[str | Path | int, ...] = (
        *("train", core / "ws1", 4, "+", "cli", "merge", core / "ws1", "-o", core / "merged", "-q", "+"),
        *("pma-init", core / "merged", core / "loaded"),
    )
    if (MCORE19 / "megatron" / "training").is_dir():
        (lm / "merged").mkdir()  # with the tracker of the merge below
        (lm / "merged" / "latest_checkpointed_iteration.txt").write_text("4")
        jobs += (
            *("+", "lm-train", lm / "ws1", 4, "+"),
            *("cli", "merge", lm / "ws1", "-o", lm / "merged" / "iter_0000004", "-q", "+"),
            *("lm-load", lm / "merged", lm / "loaded-tp1"),
        )
    loaded = run_framework(HERE / "megatron_run.py", *jobs, path=(MCORE19,))
    for line in loaded.stdout.splitlines():
        if line.startswith('{"tp"'):  # lm-load's line has the iteration it loaded
            out = lm / "loaded-tp1.json" if "iteration" in json.loads(line) else core / "pma-init.json"
            out.write_text(line)
    return {"core": core, "lm": lm}


@pytest.fixture(scope="session")
def megatron19_runs(megatron19_one_rank: dict[str, Path]) -> dict[str, Path]:
    """megatron-core 0.19.2's own code (``MCORE19``): it keeps the common state inside the DCP files
    (``common_state`` entry, no ``common.pt``). In one framework process (``megatron19_one_rank``):

    - ``ws1``: 4 iterations at TP=1, a checkpoint every iteration, as ``train`` in ``megatron_run.py``;
    - ``merged``: ``pmakit merge ws1 -o merged`` through the real CLI (``cli`` in ``megatron_run.py``), no flags;
    - ``loaded``: Megatron 0.19 loads ``merged`` (the documented recipe), saves it again and trains a step
      (``pma-init.json``).
    """
    root = megatron19_one_rank["core"]
    return {**{name: root / name for name in ("ws1", "merged", "loaded")}, "root": root}


@pytest.fixture(scope="session", params=["0.16", "0.17", "0.18", "0.19"])
def megatron_moe_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """megatron-core MoE (4 SequentialMLP experts, ``router.expert_bias`` moved every step by Megatron's own bias
    update), by 0.16.1, 0.17.1 and 0.18.2 (``common.pt``) and by 0.19.2 (the common state inside the DCP files), at
    expert parallelism EP=2 over 2 ranks (``moe-train``/``moe-pma-init`` in ``megatron_run.py``), in one framework
    process (2 ranks) each:

    - ``ws1``: 3 iterations, a checkpoint every iteration; ``merged``: ``pmakit merge ws1 -o merged`` (no flags);
    - ``loaded-ep2``, ``loaded-ep1``: what ``dist_checkpointing.load`` loaded from ``merged`` at EP=2, then at
      EP=1 (2 data-parallel replicas), saved again; each then trained a step (``root/loaded-epN.json``).
    """
    path: tuple[Path, ...] = ()
    if request.param in MCORE:
        code = MCORE[request.param]
        if not (code / "megatron" / "core").is_dir():
            pytest.skip(f"megatron-core {request.param} is not unpacked at {code} (make test does it)")
        path = (code,)
    for module in ("megatron", "psutil"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")

    root = tmp_path_factory.mktemp(f"megatron-moe-{request.param}")
    script = HERE / "megatron_run.py"
    p = {name: root / name for name in ("ws1", "merged", "loaded-ep1", "loaded-ep2")}
    loads = (
        *("moe-train", p["ws1"], 3, "+"),
        *("cli", "merge", p["ws1"], "-o", p["merged"], "-q", "+"),  # one torchrun start-up, not two
        "moe-pma-init",
        p["merged"],
        p["loaded-ep2"],
        2,
        "+",
        "moe-pma-init",
        p["merged"],
        p["loaded-ep1"],
        1,
    )
    loaded = run_framework(script, *loads, ranks=2, path=path)
    for line in loaded.stdout.splitlines():
        if line.startswith('{"tp"'):
            (root / f"loaded-ep{json.loads(line)['ep']}.json").write_text(line)
    return {**p, "root": root}


@pytest.fixture(scope="session")
def megatron_lm19_runs(megatron19_one_rank: dict[str, Path]) -> dict[str, Path]:
    """Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` (``megatron.training`` of the 0.19.2 wheel,
    ``lm-train``/``lm-load`` in ``megatron_run.py``), in 2 framework processes (TP=1: ``megatron19_one_rank``):

    - ``ws1``: 4 iterations at TP=1, ``save_checkpoint`` every iteration (its common state: args, iteration,
      checkpoint_version, the optimizer's param_groups, the scheduler, the rerun state machine);
    - ``merged``: a Megatron-LM save folder: ``pmakit merge ws1 -o merged/iter_0000004`` (no flags) and
      ``latest_checkpointed_iteration.txt``;
    - ``loaded-tp1``, ``loaded-tp2``: what ``load_checkpoint`` (``--load merged --no-load-optim``) loaded at TP=1,
      then at TP=2 over 2 ranks, saved again; each then trained a step (``root/loaded-tpN.json``).
    """
    if not (MCORE19 / "megatron" / "training").is_dir():
        pytest.skip(f"megatron-core 0.19 is not unpacked at {MCORE19} (make test does it)")
    root = megatron19_one_rank["lm"]  # ws1, merged and the TP=1 load: in the single-rank process
    p = {name: root / name for name in ("ws1", "merged", "loaded-tp1", "loaded-tp2")}
    loaded = run_framework(
        HERE / "megatron_run.py", "lm-load", p["merged"], p["loaded-tp2"], ranks=2, path=(MCORE19,)
    )
    line = next(x for x in loaded.stdout.splitlines() if x.startswith('{"tp"'))
    (root / "loaded-tp2.json").write_text(line)
    return {**p, "root": root}


@pytest.fixture(scope="session")
def torchtitan_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchtitan runs and loads (``torchtitan_run.py``: its own Trainer, llama3 debug model), in 2 processes:

    - ``ws1``: 5 steps, a checkpoint every step (``ws1/checkpoint/step-N``; step-5 the model-only last save), then in
      the same process ``pmakit merge ws1 -o merged`` and ``--format safetensors -o merged-hf`` (the real CLI, no
      token flags), torchtitan loading ``merged`` (``initial_load_path``, model only) and ``merged-hf``
      (``initial_load_in_hf``), each then taking a training step: ``loaded.pt``/``.json``, ``loaded-hf.pt``/``.json``;
    - under FSDP over 2 ranks: ``ws2-native`` (2 steps trained at world size 2) and ``ws2`` (``ws1``'s step-2..4
      loaded by torchtitan at world size 2 and saved again: the same weights), and ``online``: pmakit's
      ``PMASnapshots`` in a Trainer subclass, 2 steps, then resumed by torchtitan from its step-2 checkpoint to step 4
      (``online/dump`` torchtitan's, ``online/pma`` pmakit's snapshots every 2 steps' tokens).
    """
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    root = tmp_path_factory.mktemp("torchtitan")
    script = HERE / "torchtitan_run.py"
    p = {name: root / name for name in ("ws1", "merged", "merged-hf", "ws2", "ws2-native")}
    run_framework(
        script,
        *("train", p["ws1"], 5, "+", "cli", "merge", p["ws1"], "-o", p["merged"], "-q", "+"),
        *("cli", "merge", p["ws1"], "-o", p["merged-hf"], "-q", "--format", "safetensors", "+"),
        *("pma-init", p["merged"], root / "pma-init", root / "loaded.pt", "+"),
        *("hf-init", p["merged-hf"], root / "hf-init", root / "loaded-hf.pt"),
    )
    online = (root / "online" / "dump", root / "online" / "pma")
    run_framework(
        script,
        *("train", p["ws2-native"], 2, "+", "reshard", p["ws1"], p["ws2"], "2,3,4", "+"),
        *("online", *online, 2, "+", "online", *online, 4),
        ranks=2,
    )
    return {**p, "root": root, "online": root / "online"}


@pytest.fixture(scope="session")
def torchtitan_moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchtitan's deepseek_v3 debug model, 3 of its 6 layers (MoE: 8 grouped experts stored as ``[E, ...]``
    tensors, a shared expert, the router's aux-loss-free ``expert_bias_E``), trained by torchtitan's Trainer in one
    process: ``ws1`` (3 steps, a checkpoint every step, step-3 the model-only last save), ``pmakit merge ws1 -o
    merged`` and
    ``--format safetensors -o merged-hf`` (no token flags), torchtitan loading each and taking a training step
    (``loaded.pt``/``.json``, ``loaded-hf.pt``/``.json``, as ``torchtitan_runs``); ``lasthf`` (3 steps with
    ``--checkpoint.last_save_in_hf``: step-3 in HF names), ``lasthf-merged`` and torchtitan loading it
    (``lasthf-loaded.pt``/``.json``); then over 2 ranks at expert
    parallelism 2 (each rank holds 4 experts): ``ep2`` (2 steps), ``merged-ep2``, and torchtitan at EP=2 loading it
    and taking a step (``loaded-ep2.pt``/``.json``)."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    root = tmp_path_factory.mktemp("torchtitan_moe")
    script = HERE / "torchtitan_run.py"
    p = {name: root / name for name in ("ws1", "merged", "merged-hf")}
    run_framework(
        script,
        *("--module", "deepseek_v3", "train", p["ws1"], 3, "+"),
        *("cli", "merge", p["ws1"], "-o", p["merged"], "-q", "+"),
        *("cli", "merge", p["ws1"], "-o", p["merged-hf"], "-q", "--format", "safetensors", "+"),
        *("pma-init", p["merged"], root / "pma-init", root / "loaded.pt", "+"),
        *("hf-init", p["merged-hf"], root / "hf-init", root / "loaded-hf.pt", "+"),
        *("train", root / "lasthf", 3, "--checkpoint.last_save_in_hf", "+"),
        *("cli", "merge", root / "lasthf", "-o", root / "lasthf-merged", "-q", "+"),
        *("pma-init", root / "lasthf-merged", root / "lasthf-init", root / "lasthf-loaded.pt"),
        timeout=600,
    )
    p["lasthf"], p["lasthf-merged"] = root / "lasthf", root / "lasthf-merged"
    p["ep2"], p["merged-ep2"] = root / "ep2", root / "merged-ep2"
    run_framework(
        script,
        *("--module", "deepseek_v3", "--ep", 2, "train", p["ep2"], 2, "+"),
        *("cli", "merge", p["ep2"], "-o", p["merged-ep2"], "-q", "+"),
        *("pma-init", p["merged-ep2"], root / "pma-init-ep2", root / "loaded-ep2.pt"),
        ranks=2,
        timeout=600,
    )
    return {**p, "root": root}


@pytest.fixture(scope="session")
def olmo_core_moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """OLMo-core MoE checkpoints (``olmo_core_run.py --experts``), in one process: ``e4`` (4 experts, trained 3
    steps by OLMo-core's Trainer, a checkpoint every step; its MoE forward's two triton kernels replaced by torch ops
    in the driver), ``merged`` (``pmakit merge e4`` through the CLI, no flags), what OLMo-core's
    ``Trainer.load_checkpoint`` loaded from it (``loaded.pt``) before training a step from it, and ``e2`` (the same
    model with 2 experts, 4 steps)."""
    pytest.importorskip("olmo_core")
    root = tmp_path_factory.mktemp("olmo_core_moe")
    p = {"e4": root / "e4" / "save", "e2": root / "e2" / "save", "merged": root / "merged"}
    run_framework(
        HERE / "olmo_core_run.py",
        *(
            "experts",
            4,
            "+",
            "train",
            p["e4"],
            3,
            "+",
            "cli",
            "merge",
            p["e4"],
            "-o",
            p["merged"],
            "-q",
            "+",
        ),
        *("pma-init", p["merged"], root / "init" / "save", root / "loaded.pt", "+"),
        *("experts", 2, "+", "train", p["e2"], 4),
    )
    return {**p, "root": root}


@pytest.fixture(scope="session")
def torchtitan_settings_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchtitan's everyday checkpoint settings, each with its own Trainer (``torchtitan_run.py``), 3 steps, a
    checkpoint every step, the last one model-only (torchtitan's default), in 3 processes:

    - qwen3 MoE (``--config qwen3_moe_debug``, whose ``export_dtype="float16"`` makes the last save fp16): ``q3``;
      ``q3-merged`` and ``q3-hf`` (``pmakit merge``, no flags; ``--format safetensors``); torchtitan loading each
      and taking a step (``q3-loaded.pt``/``.json``, ``q3-loaded-hf.pt``/``.json``); ``q3-lasthf``: the same run
      with ``--checkpoint.last_save_in_hf``;
    - gpt_oss (``gpt_oss_debugmodel_flex``): ``gpt``, ``gpt-merged``, ``gpt-hf``, and torchtitan loading
      ``gpt-merged`` (``gpt-loaded.pt``/``.json``);
    - llama3 with ``--checkpoint.last_save_in_hf --checkpoint.export_dtype bfloat16``: ``l3`` (its step-3 HF
      safetensors in bf16), ``l3-merged``, torchtitan loading it (``l3-loaded.pt``/``.json``).
    """
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    root = tmp_path_factory.mktemp("torchtitan_settings")
    script = HERE / "torchtitan_run.py"
    p = {
        name: root / name
        for name in (
            "q3",
            "q3-merged",
            "q3-hf",
            "q3-lasthf",
            "gpt",
            "gpt-merged",
            "gpt-hf",
            "l3",
            "l3-merged",
        )
    }
    run_framework(
        script,
        *("--module", "qwen3", "train", p["q3"], 3, "+"),
        *("cli", "merge", p["q3"], "-o", p["q3-merged"], "-q", "+"),
        *("cli", "merge", p["q3"], "-o", p["q3-hf"], "-q", "--format", "safetensors", "+"),
        *("pma-init", p["q3-merged"], root / "q3-init", root / "q3-loaded.pt", "+"),
        *("hf-init", p["q3-hf"], root / "q3-hf-init", root / "q3-loaded-hf.pt", "+"),
        *("train", p["q3-lasthf"], 3, "--checkpoint.last_save_in_hf"),
        timeout=900,
    )
    run_framework(
        script,
        *("--module", "gpt_oss", "train", p["gpt"], 3, "+"),
        *("cli", "merge", p["gpt"], "-o", p["gpt-merged"], "-q", "+"),
        *("cli", "merge", p["gpt"], "-o", p["gpt-hf"], "-q", "--format", "safetensors", "+"),
        *("pma-init", p["gpt-merged"], root / "gpt-init", root / "gpt-loaded.pt"),
        timeout=900,
    )
    run_framework(
        script,
        *("train", p["l3"], 3, "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype", "bfloat16", "+"),
        *("cli", "merge", p["l3"], "-o", p["l3-merged"], "-q", "+"),
        *("pma-init", p["l3-merged"], root / "l3-init", root / "l3-loaded.pt"),
        timeout=900,
    )
    return {**p, "root": root}
