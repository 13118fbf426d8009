"""Config files and presets: YAML (or TOML) with a ``train:`` section and, for experiments, ``experiment:``.

Presets are ordinary config files shipped in ``pmakit/presets/``; ``pmakit experiment --print-config`` prints one
to start your own from. A config file replaces the preset it names (``preset: demo``) key by key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pmakit.errors import PmakitError
from pmakit.limits import CONFIG_BYTES, CONFIG_NODES, read_regular, refuse
from pmakit.units import parse_tokens

TOKENS = "tokens"
Tokens = Annotated[int, TOKENS]
"""A token count: a config file may write it as '4M' (``pmakit.units.parse_tokens``)."""

T = TypeVar("T")


# --------------------------------------------------------------------------------------------- the schema
# A config section is a dataclass; the bounds of each field are declared on its type, beside its docstring
# (``method_n: Annotated[int, Range(2)] = 8``), and ``check_fields`` checks every one when the section is built
# (the dataclass's __post_init__ calls it first), so a bad value is one line before anything runs. Only the checks
# that tie two fields together stay in __post_init__.


@dataclass(frozen=True)
class Range:
    """A number's bounds: ``lo`` <= value <= ``hi`` (``lo_open``/``hi_open``: that end excluded); ``off`` is also
    allowed (the value that turns a feature off, e.g. 0 tuner trials)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: float | None = None

    def problem(self, value: Any) -> str | None:
        if value == self.off or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        lo, hi = self.lo, self.hi
        below = lo is not None and (value <= lo if self.lo_open else value < lo)
        above = hi is not None and (value >= hi if self.hi_open else value > hi)
        if not (below or above):
            return None
        if lo is not None and hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo:g}, {hi:g}{')' if self.hi_open else ']'}"
        elif lo is not None:
            text = f"above {lo:g}" if self.lo_open else f"at least {lo:g}"
        else:
            text = f"below {hi:g}" if self.hi_open else f"at most {hi:g}"
        return text if self.off is None else f"{self.off:g} (off) or {text}"


POSITIVE = Range(0, lo_open=True)
AT_LEAST_1 = Range(1)
AT_LEAST_2 = Range(2)
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1, lo_open=True, hi_open=True)
"""Strictly between 0 and 1."""


@dataclass(frozen=True)
class OneOf:
    """A string among ``values``."""

    values: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        if value is None or value in self.values:
            return None
        return ", ".join(self.values[:-1]) + f" or {self.values[-1]}"


@dataclass(frozen=True)
class Length:
    """A list of at least ``lo`` values (``distinct``: no value twice)."""

    lo: int = 1
    distinct: bool = False

    def problem(self, value: Any) -> str | None:
        if len(value) < self.lo:
            return f"a list of at least {self.lo} value{'s' if self.lo > 1 else ''}"
        if self.distinct and len(set(value)) != len(value):
            return "a list of distinct values"
        return None


def check_fields(obj: Any, section: str) -> None:
    """Every declared bound of the dataclass ``obj`` (the config section ``section``), or one error naming the
    field, what it must be and what it is. A list's items are checked by the bounds on its item type."""
    cls: type = type(obj)
    for name, hint in _field_hints(cls):
        value = getattr(obj, name)
        _check_value(value, hint, f"{section}.{name}")


def _check_value(value: Any, hint: Any, where: str) -> None:
    if value is None:
        return
    if typing.get_origin(hint) is Annotated:
        for mark in typing.get_args(hint)[1:]:
            problem = mark.problem(value) if isinstance(mark, (Range, OneOf, Length)) else None
            if problem is not None:
                shown = list(value) if isinstance(value, tuple) else value
                raise PmakitError(f"{where} must be {problem}, got {shown!r}")
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            _check_value(value, options[0], where)
    elif typing.get_origin(hint) is tuple and isinstance(value, tuple):
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            for item in value:
                _check_value(item, args[0], where)


@functools.cache
def _field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def from_mapping(cls: type[T], data: Any, section: str) -> T:
    """The dataclass ``cls`` built from the mapping of the config section ``section`` (e.g. ``train``).

    Values are converted by the field's type: a nested dataclass from its own mapping (section
    ``train.model``; null = its defaults), a ``Tokens`` field from '4M', a tuple from a list (null = empty), a
    float from a string ('3e-3', which YAML reads as text). Unknown keys are one error naming the section and
    the keys and listing the known ones; the dataclass's own checks run as it is built.
    """
    if not isinstance(data, Mapping):
        raise PmakitError(f"the {section} config must be a mapping of keys to values, got {data!r}")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise PmakitError(
            f"unknown {section} config keys: {', '.join(map(str, unknown))}; known: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls, include_extras=True)
    values = {key: _convert(value, hints[key], f"{section}.{key}") for key, value in data.items()}
    for (
        key,
        value,
    ) in values.items():  # the declared bounds, named by the config's own path (e.g. sweep.recipes)
        _check_value(value, hints[key], f"{section}.{key}")
    try:
        return cls(**values)
    except TypeError as e:
        raise PmakitError(f"bad {section} config: {e}") from e


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` of a config file as the field type ``hint`` wants it (``where``: section.key, for errors)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        if TOKENS in args[1:] and isinstance(value, str):
            try:
                return parse_tokens(value)
            except PmakitError as e:
                raise PmakitError(f"{where}: {e}") from None
        if TOKENS in args[1:] and isinstance(value, float) and value.is_integer():
            return int(value)  # TOML's 1e6
        return _convert(value, args[0], where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        return from_mapping(hint, {} if value is None else value, where)
    if origin is tuple:
        return _convert_tuple(value, args, where) if value is not None else ()
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _convert(value, options[0], where) if len(options) == 1 else value
    if hint is bool:
        if not isinstance(value, bool):
            raise PmakitError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PmakitError(f"{where}: expected a whole number, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise PmakitError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PmakitError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise PmakitError(f"{where}: expected a finite number, got {value!r}")
        return value
    return value


def _convert_tuple(value: Any, args: tuple[Any, ...], where: str) -> tuple[Any, ...]:
    """A list (or tuple) of a config file as ``tuple[X, ...]`` or a fixed ``tuple[X, Y]``."""
    if not isinstance(value, (list, tuple)):
        raise PmakitError(f"{where}: expected a list, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(v, args[0], where) for v in value)
    if len(args) == len(value):
        return tuple(_convert(v, a, where) for v, a in zip(value, args))
    return tuple(value)  # the wrong length: the dataclass's own check (or its use) names it


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


def printable_preset(name: str) -> str:
    """The preset's file with its name at the top (``preset: NAME``): loaded as a config file, the values it does
    not spell out come from the same preset, so it reproduces the preset's run exactly, edited or not."""
    lines = preset_text(name).splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    line = f"preset: {name}  # the base of every value this file does not set\n"
    return "".join([*lines[:head], line, *lines[head:]])


def _parse(text: str, where: str) -> dict[str, Any]:
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_expanded_size(node, where)
        data = (loader.construct_document(node) if node is not None else None) or {}
    except yaml.YAMLError as e:
        raise PmakitError(f"{where}: not valid YAML ({e})") from e
    except RecursionError:  # PyYAML composes nested collections recursively
        raise refuse(CONFIG_NODES, f"{where} (nested too deeply)") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise PmakitError(f"{where}: expected a mapping at the top level")
    return data


def _check_expanded_size(root: Any, where: str) -> None:
    """Refuse a YAML document whose values, with every alias expanded, are over ``CONFIG_NODES``: a 1 KB file of
    nested aliases (a "billion laughs") loads as a few shared lists, then every walk over the config (merging it
    into its preset, printing it, converting it) visits each of their billions of leaves. Counted on the composed
    nodes (each shared node sized once), without building anything."""
    import yaml

    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in node.value for c in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > CONFIG_NODES.value:
                raise refuse(
                    CONFIG_NODES, f"{where} (its aliases expand to over {CONFIG_NODES.value:,} values)"
                )
            continue
        if id(node) in open_:
            raise PmakitError(f"{where}: a YAML alias refers to a value that contains it")
        open_.add(id(node))
        stack.append((node, True))
        for c in children:
            if id(c) in open_:
                raise PmakitError(f"{where}: a YAML alias refers to a value that contains it")
            if id(c) not in sizes:
                stack.append((c, False))


def read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise PmakitError(f"{path}: no such config file")
    raw = read_regular(path, CONFIG_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PmakitError(f"{path}: not UTF-8 text ({e.reason})") from None
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError as e:  # Python 3.10
            raise PmakitError(f"{path}: TOML configs need Python 3.11+; use YAML") from e
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PmakitError(f"{path}: not valid TOML ({e})") from e
        except RecursionError:
            raise refuse(CONFIG_NODES, f"{path} (nested too deeply)") from None
    return _parse(text, str(path))


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
