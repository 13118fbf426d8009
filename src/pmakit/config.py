"""Config files and presets: YAML (or TOML) with a ``train:`` section and, for experiments, ``experiment:``.

Presets are ordinary config files shipped in ``pmakit/presets/``; ``pmakit experiment --print-config`` prints one
to start your own from. A config file replaces the preset it names (``preset: demo``) key by key.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError


def preset_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files("pmakit.presets").iterdir()
        if p.name.endswith(".yaml")
    )


def preset_text(name: str) -> str:
    if name not in preset_names():
        raise PmakitError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    return resources.files("pmakit.presets").joinpath(f"{name}.yaml").read_text()


def _parse(text: str, where: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise PmakitError(f"{where}: not valid YAML ({e})") from e
    if not isinstance(data, dict):
        raise PmakitError(f"{where}: expected a mapping at the top level")
    return data


def read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise PmakitError(f"{path}: no such config file")
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError as e:  # Python 3.10
            raise PmakitError(f"{path}: TOML configs need Python 3.11+; use YAML") from e
        try:
            return tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise PmakitError(f"{path}: not valid TOML ({e})") from e
    return _parse(path.read_text(), str(path))


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` replaces ``base`` key by key, recursing into mappings."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(config: str | Path | None, preset: str | None, default_preset: str) -> dict[str, Any]:
    """The preset (``preset``, else the file's ``preset:`` key, else ``default_preset``) overlaid with the file."""
    data = read_file(config) if config else {}
    name = preset or data.pop("preset", None) or default_preset
    data.pop("preset", None)
    return merge_dicts(_parse(preset_text(name), f"preset {name}"), data) | {"preset": name}
