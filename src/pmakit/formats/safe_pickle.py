"""Untrusted pickles (DCP ``.metadata``, the small ``data.pkl`` of a ``.distcp`` record) turned into plain data.

A pickle is a program: besides building objects it can call any global it names (REDUCE), set attributes on what it
built (BUILD), and store items into it (SETITEM, APPEND). An allow-list in ``find_class`` alone is not enough: a
pickle that names an allowed *class* can BUILD on the class object itself and set, say, ``PosixPath.is_file`` for
the rest of the process. So no pickle opcode here ever reaches a real class or a real object:

1. The pickle VM runs with every global replaced by a *fresh placeholder class*, made for this one load. Calling it
   (REDUCE, NEWOBJ, ``copyreg._reconstructor``), BUILD, SETITEM and APPEND on its instances only record their
   arguments in the placeholder. Whatever the pickle does, it touches only objects this load created.
2. The recorded tree is then rebuilt from the bottom up by ``Rebuilder``: each global is looked up in a table of
   constructors (``Allowed``) that check their arguments (types, ranges, field names) and build a fresh object
   through its ordinary constructor. Anything else is refused. The tree walk is iterative-safe (a depth limit),
   shares what the pickle shared (a memo by identity, so a DAG cannot blow up) and refuses cycles.

Every failure is a ``PmakitError`` (the caller adds the file name); nothing else escapes.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import pickletools
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pmakit.errors import PmakitError

MAX_DEPTH = 64
"""Nesting of containers and objects in one pickle (DCP metadata is about 8 deep)."""
MAX_NODES = 10_000_000
"""Objects rebuilt from one pickle: a DCP ``.metadata`` holds about 12 per tensor chunk."""

Global = tuple[str, str]
"""(module, qualified name) as the pickle names a global."""


class _Placeholder:
    """What a pickle builds in place of any global: records how it was made and what was set on it."""

    _ref: Global = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> _Placeholder:
        self = object.__new__(cls)
        self.__dict__.update(args=args, kwargs=kwargs, state=None, items=[], appended=[], built=False)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if self.__dict__["built"]:
            raise pickle.UnpicklingError("BUILD twice on one object")
        self.__dict__.update(state=state, built=True)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["items"].append((key, value))

    def append(self, value: Any) -> None:
        self.__dict__["appended"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["appended"].extend(values)

    def __setattr__(self, name: str, value: Any) -> None:
        raise pickle.UnpicklingError("a pickle may not set attributes")


class PersistentId(tuple[Any, ...]):
    """A persistent id (``torch.save``'s storage references), rebuilt as plain data for the caller."""

    def __new__(cls, pid: Any) -> PersistentId:
        return tuple.__new__(cls, (pid,))


class _VM(pickle.Unpickler):
    """Runs the pickle with placeholders for every global (see the module docstring)."""

    def __init__(self, file: io.BytesIO, persistent_ids: bool) -> None:
        super().__init__(file)
        self._classes: dict[Global, type[_Placeholder]] = {}
        self._persistent_ids = persistent_ids

    def find_class(self, module: str, name: str) -> Any:
        ref = (str(module), str(name))
        if ref not in self._classes:
            self._classes[ref] = type("Placeholder", (_Placeholder,), {"_ref": ref})
        return self._classes[ref]

    def persistent_load(self, pid: Any) -> Any:
        if not self._persistent_ids:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return PersistentId(pid)


@dataclasses.dataclass(frozen=True)
class StandIn:
    """An inert record of an object of a class pmakit does not build (a trainer's own class): its global, the
    arguments it was made with and its state, all plain data."""

    ref: Global
    args: tuple[Any, ...]
    state: Any


@dataclasses.dataclass(frozen=True)
class Made:
    """How the pickle made one object of an allowed global: the arguments of its call, the state BUILD gave it,
    the items SETITEM stored into it and the values APPEND added, each already rebuilt."""

    ref: Global
    args: tuple[Any, ...]
    state: Any
    items: list[tuple[Any, Any]]
    appended: list[Any]

    def no_items(self) -> None:
        if self.items or self.appended:
            raise PmakitError(f"{_name(self.ref)} takes no items")


Constructor = Callable[[Made], Any]


class Allowed:
    """What one kind of pickle may build: constructors for calls, constants for bare globals, stand-ins by
    package prefix."""

    def __init__(
        self,
        constructors: Mapping[Global, Constructor],
        constants: Mapping[Global, Any] | None = None,
        stand_in_packages: tuple[str, ...] = (),
        aliases: Callable[[Global], Global | None] | None = None,
    ) -> None:
        self.constructors = dict(constructors)
        self.constants = dict(constants or {})
        self.stand_in_packages = stand_in_packages
        self.aliases = aliases

    def resolve(self, ref: Global) -> Global:
        alias = self.aliases(ref) if self.aliases is not None else None
        return alias if alias is not None else ref


def _name(ref: Global) -> str:
    return f"{ref[0]}.{ref[1]}"


class Rebuilder:
    """Turns what the VM recorded into fresh objects through ``allowed``'s constructors."""

    def __init__(self, allowed: Allowed) -> None:
        self.allowed = allowed
        self._memo: dict[int, Any] = {}
        self._busy: set[int] = set()
        self._keep: list[Any] = []  # keeps recorded objects alive so that ids in the memo stay unique
        self._count = 0

    def build(self, obj: Any, depth: int = 0) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            return obj
        key = id(obj)
        if key in self._memo:
            return self._memo[key]
        if key in self._busy:
            raise PmakitError("the pickle refers to itself (a cycle)")
        if depth > MAX_DEPTH:
            raise PmakitError(f"nested deeper than {MAX_DEPTH} levels (limit: pickle depth)")
        self._count += 1
        if self._count > MAX_NODES:
            raise PmakitError(f"more than {MAX_NODES:,} objects (limit: pickle objects)")
        self._busy.add(key)
        self._keep.append(obj)
        try:
            value = self._build(obj, depth + 1)
        finally:
            self._busy.discard(key)
        self._memo[key] = value
        return value

    def _build(self, obj: Any, depth: int) -> Any:
        kind = type(obj)
        if kind is tuple:
            return tuple(self.build(x, depth) for x in obj)
        if kind is list:
            return [self.build(x, depth) for x in obj]
        if kind is dict:
            return {self._key(k, depth): self.build(v, depth) for k, v in obj.items()}
        if kind in (set, frozenset):
            return kind(self._key(x, depth) for x in obj)
        if kind is bytearray:
            return bytes(obj)
        if kind is PersistentId:
            return PersistentId(self.build(obj[0], depth))
        if isinstance(obj, type) and issubclass(obj, _Placeholder):
            ref = self.allowed.resolve(obj._ref)
            if ref in self.allowed.constants:
                return self.allowed.constants[ref]
            if ref[0].startswith(self.allowed.stand_in_packages):
                return StandIn(ref, (), None)  # the class itself, named and never resolved
            raise PmakitError(f"refused: {_name(obj._ref)} as a value")
        if isinstance(obj, _Placeholder):
            return self._object(obj, depth)
        raise PmakitError(f"refused: a {kind.__name__} object")

    def _key(self, key: Any, depth: int) -> Any:
        value = self.build(key, depth)
        try:
            hash(value)
        except TypeError:
            raise PmakitError(f"refused: an unhashable {type(value).__name__} as a key") from None
        return value

    def _object(self, obj: _Placeholder, depth: int) -> Any:
        fields = obj.__dict__
        ref = type(obj)._ref
        args = fields["args"]
        if ref == ("copyreg", "_reconstructor"):
            # (cls, base, base_state): a new cls, then BUILD; only the class matters
            cls = args[0] if args else None
            if not (isinstance(cls, type) and issubclass(cls, _Placeholder)):
                raise PmakitError("refused: copyreg._reconstructor of something that is not a class")
            ref, args = cls._ref, ()
        if fields["kwargs"]:
            raise PmakitError(f"refused: keyword arguments to {_name(ref)}")
        made = Made(
            ref,
            tuple(self.build(a, depth) for a in args),
            self.build(fields["state"], depth),
            [(self._key(k, depth), self.build(v, depth)) for k, v in fields["items"]],
            [self.build(v, depth) for v in fields["appended"]],
        )
        resolved = self.allowed.resolve(ref)
        constructor = self.allowed.constructors.get(resolved)
        if constructor is not None:
            try:
                return constructor(made)
            except PmakitError:
                raise
            except Exception as e:  # a constructor given arguments of the wrong kind
                raise PmakitError(
                    f"refused: {_name(ref)} with bad arguments ({type(e).__name__}: {e})"
                ) from e
        if ref[0].startswith(self.allowed.stand_in_packages):
            made.no_items()
            return StandIn(ref, made.args, made.state)
        raise PmakitError(f"refused to unpickle {_name(ref)} (not allowed here)")


def loads(data: bytes, allowed: Allowed, *, persistent_ids: bool = False) -> Any:
    """The plain data a pickle describes, built only through ``allowed`` (see the module docstring).

    ``persistent_ids``: let the pickle hold persistent ids (``torch.save``'s storage references); each comes back
    as a ``PersistentId`` wrapping its rebuilt id. Refused otherwise.
    """
    try:
        _prescan(data)
        recorded = _VM(io.BytesIO(data), persistent_ids).load()
        return Rebuilder(allowed).build(recorded)
    except PmakitError:
        raise
    except RecursionError:
        raise PmakitError(
            f"nested deeper than the interpreter allows (limit: pickle depth {MAX_DEPTH})"
        ) from None
    except Exception as e:  # any opcode stream: pickle, EOF, type, value, attribute, memory errors
        raise PmakitError(f"not a valid pickle ({type(e).__name__}: {_first_line(e)})") from None


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_REFUSED_OPS = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"})
"""Out-of-band buffers (protocol 5): no file pmakit reads uses them, and BYTEARRAY8 allocates its claimed length
before reading it."""


def _prescan(data: bytes) -> None:
    """Walk the opcodes (``pickletools``, pure Python, bounded by the data) before the VM runs them: the VM
    allocates what an opcode claims before checking it (a memo index of 4e9 grows the memo to 32 GB; a
    BYTEARRAY8 of 2**40 allocates its bytes), so such claims are refused here."""
    for ops, (op, arg, _) in enumerate(pickletools.genops(data), start=1):
        if ops > MAX_NODES:
            raise PmakitError(f"more than {MAX_NODES:,} opcodes (limit: pickle objects)")
        if op.name in _REFUSED_OPS:
            raise PmakitError(f"refused: opcode {op.name}")
        if op.name in _MEMO_OPS and isinstance(arg, int) and arg > ops:
            # the pickler numbers memo entries in order: no index is larger than the opcodes before it
            raise PmakitError(f"refused: memo index {arg} after {ops} opcodes")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


# -- argument checks shared by the constructors -------------------------------------------------------------------


def expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and kind is int:
        raise PmakitError(f"refused: {what} must be {kind.__name__}, got bool")
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise PmakitError(f"refused: {what} must be {names}, got {type(value).__name__}")
    return value


def count(value: Any, what: str) -> int:
    """A non-negative integer that fits in int64."""
    expect(value, int, what)
    if not 0 <= value < 2**63:
        raise PmakitError(f"refused: {what} out of range ({value})")
    return int(value)


def make_size(made: Made) -> torch.Size:
    made.no_items()
    if made.state is not None or len(made.args) > 1:
        raise PmakitError("refused: torch.Size takes one tuple")
    dims = made.args[0] if made.args else ()
    expect(dims, (tuple, list), "torch.Size's dims")
    return torch.Size([count(d, "a torch.Size dim") for d in dims])


def make_ordered_dict(made: Made) -> collections.OrderedDict[Any, Any]:
    if made.args or made.state is not None or made.appended:
        raise PmakitError("refused: OrderedDict takes only items")
    return collections.OrderedDict(made.items)


def make_path(cls: type[pathlib.PurePath]) -> Constructor:
    def build(made: Made) -> pathlib.PurePath:
        made.no_items()
        if made.state is not None:
            raise PmakitError(f"refused: state on {cls.__name__}")
        parts = [expect(a, str, f"a {cls.__name__} part") for a in made.args]
        return cls(*parts)

    return build


def make_enum(cls: type[enum.Enum]) -> Constructor:
    def build(made: Made) -> enum.Enum:
        made.no_items()
        if made.state is not None or len(made.args) != 1:
            raise PmakitError(f"refused: {cls.__name__} takes one value")
        return cls(made.args[0])

    return build


def make_dataclass(
    cls: type, checks: Mapping[str, Callable[[Any], Any]] | None = None, extra: bool = False
) -> Constructor:
    """A dataclass from the state BUILD gave it (``{field: value}``, or ``(dict, None)``): its own fields, each
    through ``checks[field]`` where given, built by its own ``__init__`` (defaults for missing fields).

    ``extra``: other names in the state become attributes of the fresh instance (Megatron adds its global save
    plan to torch's ``Metadata`` so); only plain lower-case names, never a dunder such as ``__class__``.
    """
    names = {f.name for f in dataclasses.fields(cls)}

    def build(made: Made) -> Any:
        made.no_items()
        if made.args:
            raise PmakitError(f"refused: arguments to {cls.__name__}")
        state = made.state
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]
        state = {} if state is None else dict(expect(state, dict, f"{cls.__name__}'s state"))
        others = {k: state.pop(k) for k in list(state) if k not in names}
        bad = [k for k in others if not (extra and isinstance(k, str) and _ATTRIBUTE.fullmatch(k))]
        if bad:
            raise PmakitError(f"refused: {cls.__name__} has no field {str(bad[0])[:80]!r}")
        for field, check in (checks or {}).items():
            if field in state:
                state[field] = check(state[field])
        obj = cls(**state)
        for name, value in others.items():
            object.__setattr__(obj, name, value)
        return obj

    return build


_ATTRIBUTE = re.compile(r"[a-z][a-z0-9_]{0,63}")


def plain(value: Any, what: str = "a value") -> Any:
    """Plain data only (None, numbers, strings, bytes and containers of them)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v, what) for v in value)
    if isinstance(value, dict):
        return {plain(k, what): plain(v, what) for k, v in value.items()}
    raise PmakitError(f"refused: {what} holds a {type(value).__name__}")


def dtypes() -> dict[Global, torch.dtype]:
    return {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def make_layout(made: Made) -> torch.layout:
    made.no_items()
    if len(made.args) != 1 or made.state is not None:
        raise PmakitError("refused: _get_layout takes one name")
    name = expect(made.args[0], str, "a layout name")
    known = layouts()
    if name not in known:
        raise PmakitError(f"refused: unknown layout {name[:60]!r}")
    return known[name]
