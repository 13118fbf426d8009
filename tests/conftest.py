"""Fixtures: small synthetic snapshots built on the fly (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ or "PMAKIT_TESTS_INDUCTOR" in os.environ:
    # A fresh kernel cache for each process of the suite (the xdist controller's folder, then one per worker inside
    # it) and the processes it starts: inductor's shared one (/tmp/torchinductor_$USER) is not keyed by
    # ATEN_CPU_CAPABILITY, and kernels built under another capability (an older pmakit's AVX2 pin, another torch
    # program) give wrong numbers without an error when loaded (see pmakit._env.portable_math). Not shared between
    # the workers either (one folder for both was inherited from the controller before).
    # Not kept: OMP_NUM_THREADS=1 for the workers and what they start (16:40-17:05 instead of ~18 min): with it, the
    # in-process compiled evaluation (tests/test_train.py) scored NaN in three of six full runs, with one cache or
    # one a worker; never without it. Not understood.
    import atexit
    import shutil
    import tempfile

    parent = os.environ.get("PMAKIT_TESTS_INDUCTOR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pmakit-tests-inductor-", dir=parent)
    os.environ.setdefault("PMAKIT_TESTS_INDUCTOR", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import atexit
import functools
import gc
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pmakit.formats.safetensors_io import save_file
from pmakit.snapshot import write_metadata

SRC = Path(__file__).resolve().parents[1] / "src"

SHAPES: dict[str, tuple[int, ...]] = {
    "embed.weight": (64, 16),
    "layers.0.attn.weight": (16, 16),
    "layers.0.norm.weight": (16,),
    "layers.1.attn.weight": (16, 16),
    "head.weight": (64, 16),
}


def state(
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """A deterministic state dict with float weights and one integer buffer."""
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(s, generator=g).to(dtype) for k, s in (shapes or SHAPES).items()}
    tensors["step_counter"] = torch.tensor([seed], dtype=torch.int64)
    return tensors


def write_snapshot(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    step: int,
    tokens: int,
    fmt: str = "safetensors",
    extra_files: dict[str, str] | None = None,
) -> Path:
    """One snapshot directory in the given format, with pmakit.json written last."""
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(tensors, path / "model.safetensors")
    elif fmt == "pt":
        torch.save(tensors, path / "model.pt")
    elif fmt == "nested-pt":
        torch.save(
            {"model": tensors, "optimizer": {"lr": torch.tensor(0.1)}, "iter_num": 3}, path / "ckpt.pt"
        )
    else:
        raise ValueError(fmt)
    for name, text in (extra_files or {"config.json": '{"model_type": "toy"}'}).items():
        (path / name).write_text(text)
    write_metadata(path, step=step, tokens=tokens, lr=1e-3, loss=3.0)
    return path


def write_states(
    run: Path,
    states: Sequence[dict[str, torch.Tensor]],
    *,
    every: int = 10,
    tokens_per_step: int = 100,
    digits: int = 0,
    fmt: str = "safetensors",
) -> Path:
    """A run of one snapshot per state, oldest first: ``run/step-<k * every>`` (zero-padded to ``digits``) at
    ``tokens_per_step`` tokens a step."""
    for k, tensors in enumerate(states, start=1):
        step = k * every
        path = run / f"step-{step:0{digits}d}"
        write_snapshot(path, tensors, step=step, tokens=step * tokens_per_step, fmt=fmt)
    return run


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an output directory, read back through the reference safetensors reader."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[k] = h.get_tensor(k)
    return out


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., Path]:
    """make_run(n=5, every=100, dtype=bf16, fmt="safetensors") -> run dir with snapshots step-<k*every>."""

    def build(
        n: int = 5,
        *,
        every: int = 100,
        tokens_per_step: int = 10,
        dtype: torch.dtype = torch.bfloat16,
        fmt: str = "safetensors",
        name: str = "run",
    ) -> Path:
        states = [state(i, dtype) for i in range(1, n + 1)]
        return write_states(
            tmp_path / name, states, every=every, tokens_per_step=tokens_per_step, digits=6, fmt=fmt
        )

    return build


def fake_node(
    root: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], cpus: int | None = None
) -> None:
    """A node as ``pmakit.merge.resources`` reads it: ``files`` (the cgroup tree under ``cg/``, this process's
    ``proc-cgroup`` line(s), ``meminfo``) written under ``root`` and read from there instead of /sys and /proc;
    with ``cpus``, that many CPUs in this process's affinity mask."""
    from pmakit.merge import resources

    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(resources, "CGROUP_ROOT", root / "cg")
    monkeypatch.setattr(resources, "PROC_CGROUP", root / "proc-cgroup")
    if "meminfo" in files:
        monkeypatch.setattr(resources, "MEMINFO", root / "meminfo")
    if cpus is not None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts to run pmakit: this checkout's sources and passive OpenMP waits,
    with ``extra`` on top."""
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE", **extra}


@functools.cache
def _launchers() -> tuple[Any, ...]:
    """This pytest process's two launchers (tests/cli_launcher.py), closed at its exit."""
    from cli_launcher import Launcher

    launchers = (Launcher(cli_env()), Launcher(cli_env(), pinned=True))
    for launcher in launchers:
        atexit.register(launcher.close)
    return launchers


def run_cli(
    *args: str | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run the real `pmakit` entry point (``python -m pmakit``'s code) on this checkout's sources (``cli_env``), in
    a process of its own: forked from one of the suite's launchers, which have loaded torch and the CLI once
    (tests/cli_launcher.py), or a fresh interpreter (``fresh=True``; an environment that changes what is read at
    import; everywhere with PMAKIT_TESTS_FRESH=1 in the suite's environment)."""
    words, env = [str(a) for a in args], cli_env(**(env or {}))
    if not fresh and not os.environ.get("PMAKIT_TESTS_FRESH"):
        for launcher in _launchers():
            if launcher.takes(words, env):
                return launcher.run(words, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "pmakit", *words],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def smoke_experiment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`pmakit experiment --preset smoke` run once per session through the real CLI: (run dir, its stdout)."""
    run = tmp_path_factory.mktemp("exp") / "smoke"
    proc = run_cli("experiment", "--preset", "smoke", "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


@pytest.fixture(scope="session")
def scaling_smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`pmakit experiment --preset scaling-smoke` run once per session through the real CLI: (run dir, stdout)."""
    run = tmp_path_factory.mktemp("scaling") / "run"
    proc = run_cli("experiment", "--preset", "scaling-smoke", "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


@pytest.fixture(scope="session")
def sweep_smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pmakit experiment --preset sweep-smoke` run once per session through the real CLI: the run directory."""
    run = tmp_path_factory.mktemp("sweep") / "run"
    proc = run_cli("experiment", "--preset", "sweep-smoke", "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Sweep study" in proc.stdout and "truth (annealed at D" in proc.stdout
    return run


# --- Running the suite on both cores (pytest-xdist, `make test` passes -n 2 --dist loadgroup) -------------------
# A session- or module-scoped fixture here builds something slow once (a study run, a framework's checkpoints). Tests
# that share one must run in the same worker, or each worker builds it again. Every test gets the xdist_group of the
# shared fixtures it needs, joined across tests (union-find), so whole families land in one worker and the rest of
# the suite is spread test by test.
_TESTS = Path(__file__).resolve().parent


def _shared_fixtures(item: pytest.Item) -> list[str]:
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name, defs in info.name2fixturedefs.items() if info else ():
        fixture = defs[-1]
        if fixture.scope not in ("session", "module"):
            continue
        try:
            source = Path(sys.modules[fixture.func.__module__].__file__ or "").resolve()
        except (KeyError, TypeError):
            continue
        if _TESTS not in source.parents:  # pytest's own (tmp_path_factory, ...)
            continue
        keys.append(name if fixture.scope == "session" else f"{item.module.__name__}::{name}")  # type: ignore[attr-defined]
    # Fixtures a test takes with request.getfixturevalue, named by @pytest.mark.shares(...)
    keys += [name for mark in item.iter_markers("shares") for name in mark.args]
    return keys


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {item.nodeid: _shared_fixtures(item) for item in items}
    for keys in shared.values():
        for other in keys[1:]:
            parent[root(other)] = root(keys[0])
    for item in items:
        if shared[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(shared[item.nodeid][0]).replace("::", ".")))


class _LoadGroupCheck:
    """Fails the run if pytest-xdist did not tag the grouped tests (a pytest/xdist pair that no longer agree)."""

    @pytest.hookimpl(trylast=True)  # after xdist's worker hook has added "@group" to each grouped test's id
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        untagged = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if untagged:
            raise pytest.UsageError(
                f"pytest-xdist did not apply --dist loadgroup (pytest {pytest.__version__}): {untagged[0]} has an "
                "xdist_group but no @group in its id, so every worker would build the groups' study runs again; "
                "see the pytest pin in pyproject.toml"
            )


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Each test ends with the environment variables it began with (pytest's own PYTEST_CURRENT_TEST aside). A
    library that a test loads in-process may set some for the rest of the process (``import lightning`` sets
    PYTORCH_NVML_BASED_CUDA_CHECK): left there, each later ``run_cli`` of that worker differed from its launcher's
    environment in an import-time variable and started a fresh interpreter instead (237 commands of a full suite,
    459 CPU-s between them; found by logging every process's CPU at exit)."""
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    for key in os.environ.keys() - before.keys() - {"PYTEST_CURRENT_TEST"}:
        del os.environ[key]
    os.environ.update(before)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The objects the collection created (torch, the frameworks, the test modules) live to the end of the run: frozen,
    as pmakit's CLI freezes torch's after its import, and the youngest generation collected every 10,000
    allocations instead of 700. The cyclic collector took 9.6 s of a 144 s run of five in-process-heavy test files
    (test_merge, test_report, test_scaling_fit, layouts/test_torchtitan, test_train; ``gc.callbacks`` timing), 4.7 s
    frozen, 2.5 s frozen with the threshold: 134 s. Nothing a test asserts depends on when garbage is collected
    (the one test that needs it collected calls ``gc.collect()``)."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_LoadGroupCheck(), "pmakit-loadgroup-check")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Any]:
    """A real S3 API server (moto) on a free localhost port for the whole session; ``.env()`` points a client at
    it with fake credentials (AWS_ENDPOINT_URL, as for MinIO or R2)."""
    pytest.importorskip("moto.server", reason="the object-storage tests need moto[server] (the test extra)")
    from s3server import MotoServer

    server = MotoServer()
    yield server
    server.stop()
