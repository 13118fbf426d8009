"""``pmakit experiment --preset moe``: the PMA study on a mixture of experts, then what merging does to its routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def run_moe_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """The PMA study (``pmakit.lab.pma``) on the MoE model, then the MoE tables; returns the report's path."""
    from pmakit.lab.pma import run_pma_study

    return run_pma_study(data, run_dir, fresh=fresh, progress=progress)
