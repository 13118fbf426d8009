"""``import pmakit``: the API the docs show (merge, plan, inspect, the online averager, the saver, average_states)
is there, loaded on first use, so that the import itself stays light; test hooks are not part of it."""

from __future__ import annotations

import subprocess
import sys

from conftest import SRC


def run(code: str) -> str:
    env = {"PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_import_pmakit_loads_no_torch_and_exposes_the_api_on_use() -> None:
    out = run(
        "import sys, pmakit\n"
        "print('torch' in sys.modules)\n"
        "names = ['merge', 'plan_merge', 'inspect_inputs', 'discover', 'OnlineAverager', 'SnapshotSaver',\n"
        "         'average_states', 'TensorPolicy', 'Weighting']\n"
        "print(all(n in pmakit.__all__ and n in dir(pmakit) and callable(getattr(pmakit, n)) for n in names))\n"
        "import pmakit.online, pmakit.saver, pmakit.merge\n"
        "print(pmakit.OnlineAverager is pmakit.online.OnlineAverager, pmakit.SnapshotSaver is pmakit.saver.SnapshotSaver)"
    )
    assert out.splitlines() == ["False", "True", "True True"]


def test_test_hooks_are_off_the_public_face() -> None:
    out = run(
        "import pmakit.merge as m\n"
        "print([n for n in ('KILL_ENV', 'CHUNK_ELEMS', 'N_BUFFERS', 'Killer') if n in m.__all__ or hasattr(m, n)])\n"
        "from pmakit.merge._faults import KILL_ENV; print(KILL_ENV)"
    )
    assert out.splitlines() == ["[]", "PMAKIT_TEST_KILL"]


def test_pmakit_merge_is_callable_after_its_package_is_imported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``import pmakit.merge`` binds the package to ``pmakit.merge``: the README's ``pmakit.merge(...)`` still works."""
    out = run(
        "import torch, pmakit, pmakit.merge\n"
        "from safetensors.torch import save_file, load_file\n"
        "from pmakit.snapshot import write_metadata\n"
        "from pathlib import Path\n"
        f"root = Path({str(tmp_path)!r})\n"
        "snaps = []\n"
        "for i in (1, 2):\n"
        "    d = root / f'step-{i}'; d.mkdir()\n"
        "    save_file({'w': torch.full((2,), float(i))}, str(d / 'model.safetensors'))\n"
        "    write_metadata(d, step=i, tokens=100 * i)\n"
        "    snaps.append(d)\n"
        "snaps = pmakit.discover(root)\n"
        "pmakit.merge(snaps, [0.5, 0.5], root / 'out')\n"
        "print(load_file(str(root / 'out' / 'model.safetensors'))['w'].tolist())"
    )
    assert out.splitlines()[-1] == "[1.5, 1.5]"
