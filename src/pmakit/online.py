"""The running average of the last N snapshots, kept in CPU fp32 while training runs.

The average of the window x_1..x_m (oldest first, m <= N) is ``sum_i w_i x_i`` with exactly the weights of
``pmakit.weights.get_weights(method, m, alpha)``, the same as ``pmakit merge`` over those snapshots. No update
re-reads the window: each method keeps running sums that the newest snapshot (in hand) and at most two old ones
(read back from their snapshot directories, or held in memory with ``hold_in_memory=True``) bring up to date.
With a = alpha, n = N and a full window sliding from x_1..x_n to x_2..x_{n+1}:

====================  =============================================  ================================  =========
method                running state                                  slide update                      reads
====================  =============================================  ================================  =========
sma                   S = sum x_i                                    S += x_new - x_1                  1
wma                   S = sum x_i, W = sum i x_i                     W += n x_new - S; S += x_new-x_1  1
ema (seeded)          E = the window's seeded EMA                    E = (1-a)E + a x_new              2
                                                                         - (1-a)^n x_1 + (1-a)^n x_2
ema-normalized        U = sum a(1-a)^(m-i) x_i                       U = (1-a)U + a x_new              1
                                                                         - a(1-a)^n x_1
wsm-*                 the average itself                             recomputed from the window        N-1
====================  =============================================  ================================  =========

Averages: sma S/m, wma W/(m(m+1)/2), ema E, ema-normalized U/(1-(1-a)^m). (The EMA identity: E over x_2..x_{n+1}
minus (1-a)E + a x_{n+1} leaves (1-a)^n (x_2 - x_1), because x_2 turns from a weight a(1-a)^(n-1) into the seed's
(1-a)^(n-1), and x_1's weight (1-a)^n leaves.)

Memory: one fp32 copy of the model's floating-point tensors for sma, ema, ema-normalized and wsm-* (two for wma:
S and W), plus, during an update, the new snapshot the caller holds and one tensor at a time of the snapshots read
back (memory-mapped: page cache, not process memory). ``hold_in_memory`` adds the window's N snapshots in their own
dtype. ``nbytes`` reports what is held. Measured with a saver feeding it (bf16 model, 50M parameters, N=3; peak
RssAnon above the model): sma and ema 329 MiB = 192 MiB of sums + 96 MiB snapshot in flight + ~40 MiB of
buffers; wma 500 MiB; sma with hold_in_memory 740 MiB. At 201M parameters sma peaks at 1188 MiB = 768 + 384 + 36.

Adding and subtracting in fp32 drifts slowly (a random walk of rounding errors); every ``resum_every`` updates the
running sums are rebuilt from the window (N-1 reads), which bounds the drift to that of ``resum_every`` updates.

Thread safety: every method takes one lock, so ``update`` can run on the saver's writer thread (``on_save``)
while the training thread evaluates with ``swapped_in``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.formats import Reader, open_reader
from pmakit.layouts.kinds import DEFAULT_BUFFERS, Kind, TensorPolicy
from pmakit.saver import alias_key, drop_aliases
from pmakit.snapshot import IncompleteSnapshot, Snapshot, read_snapshot
from pmakit.weights import WEIGHTINGS, get_weights, weighting

log = logging.getLogger(__name__)

STATE_VERSION = 1
_Read = Callable[[str], torch.Tensor]


def accumulator_coefficients(method: str, m: int, alpha: float) -> dict[str, list[float]]:
    """The running sums of ``method`` over a window of m snapshots: name -> one coefficient per snapshot."""
    running = weighting(method).running
    if running is None:  # kept as the average itself, recomputed from the window
        return {"avg": get_weights(method, m, alpha=alpha)}
    return running.coefficients(m, alpha)


def _average_factor(method: str, m: int, alpha: float) -> tuple[str, float]:
    """The average as (running sum, factor): average = factor * sum."""
    running = weighting(method).running
    return ("avg", 1.0) if running is None else running.average(m, alpha)


@dataclass
class _Entry:
    tokens: int
    path: Path | None
    held: dict[str, torch.Tensor] | None = None
    """The snapshot's floating-point tensors, with hold_in_memory."""


class OnlineAverager:
    """Keeps the ``method`` average of the last ``n`` snapshots in CPU fp32.

    Args:
        n: the window, N snapshots.
        method: a weighting of ``pmakit.weights`` (sma, wma, ema, ema-normalized, wsm-linear, wsm-cosine,
            wsm-1sqrt).
        alpha: the EMA factor.
        hold_in_memory: keep the window's snapshots in memory instead of reading the dropped ones back from disk.
        resum_every: rebuild the running sums from the window every this many updates, bounding fp32 drift
            (0: never).
        buffers: MoE routers' load-balancing biases ``average``-d like the weights, or the newest snapshot's
            (``latest``), as ``pmakit merge --buffers`` says (one ``TensorPolicy``): the average then equals the
            offline merge of the window. Counters and other non-float tensors are always the newest snapshot's.
    """

    def __init__(
        self,
        n: int = 10,
        method: str = "sma",
        alpha: float = 0.2,
        *,
        hold_in_memory: bool = False,
        resum_every: int = 64,
        buffers: str = DEFAULT_BUFFERS,
    ) -> None:
        from pmakit._env import warn_if_spinning

        warn_if_spinning()  # at the user's first call, where torch was imported before pmakit
        if n < 1:
            raise PmakitError(f"the averaging window needs at least one snapshot, got n={n}")
        if method not in WEIGHTINGS:
            raise PmakitError(f"unknown method {method!r}; known: {', '.join(WEIGHTINGS)}")
        get_weights(method, n, alpha=alpha)  # validates alpha
        self._running = WEIGHTINGS[method].running
        self.policy = TensorPolicy(buffers)
        self.n = n
        self.method = method
        self.alpha = alpha
        self.hold_in_memory = hold_in_memory
        self.resum_every = resum_every
        self.updates = 0
        """Snapshots seen since the start (the window holds the last ``n``)."""
        self._since_resum = 0
        self._entries: list[_Entry] = []
        self._sums: dict[str, dict[str, torch.Tensor]] = {}
        self._spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # float keys -> (shape, saved dtype)
        self._nonfloat: dict[str, torch.Tensor] = {}  # the tensors not averaged: the newest snapshot's
        self._lock = threading.RLock()

    # -- what it holds ------------------------------------------------------------------------------------------

    @property
    def label(self) -> str:
        """How evaluations of this average are named in metrics: ``merged:<method>:<N>``."""
        return f"merged:{self.method}:{self.n}"

    @property
    def count(self) -> int:
        """Snapshots in the window now (N once the window is full)."""
        return len(self._entries)

    @property
    def window(self) -> list[tuple[int, Path | None]]:
        """(tokens, snapshot path) of the window, oldest first."""
        return [(e.tokens, e.path) for e in self._entries]

    @property
    def tokens(self) -> int | None:
        """Tokens of the newest snapshot in the window."""
        return self._entries[-1].tokens if self._entries else None

    @property
    def nbytes(self) -> int:
        """Bytes of tensors the averager holds (running sums, held snapshots, non-float tensors)."""
        with self._lock:
            total = sum(t.nbytes for sums in self._sums.values() for t in sums.values())
            total += sum(t.nbytes for e in self._entries if e.held for t in e.held.values())
            return total + sum(t.nbytes for t in self._nonfloat.values())

    # -- updating -----------------------------------------------------------------------------------------------

    def update(self, state: Mapping[str, torch.Tensor], *, tokens: int, path: Path | None = None) -> None:
        """Add the snapshot ``state`` taken at ``tokens`` (saved at ``path``) and drop the oldest past N.

        ``state`` must hold the values that were saved at ``path`` (the same dtype): the dropped snapshot is
        subtracted as read back from disk. Tied aliases are dropped as the saver drops them.
        """
        with self._lock:
            if self._entries and tokens <= self._entries[-1].tokens:
                raise PmakitError(
                    f"snapshots must come in token order: got {tokens} tokens after {self._entries[-1].tokens}"
                )
            if path is None and not self.hold_in_memory:
                raise PmakitError(
                    "OnlineAverager.update needs the snapshot's path to read it back when it leaves the window; "
                    "pass path=, or construct the averager with hold_in_memory=True"
                )
            state, _ = drop_aliases(state)
            self._check_keys(state, tokens)
            new = _Entry(tokens, Path(path) if path is not None else None)
            if self.hold_in_memory:
                new.held = {k: state[k].detach().to("cpu", copy=True) for k in self._spec}
            resum = self.resum_every and self._since_resum + 1 >= self.resum_every
            if self._running is not None and not resum:
                self._slide(new, state)
                self._since_resum += 1
            else:
                entries = self._entries
                self._entries = [*entries, new][-self.n :]
                try:
                    self._rebuild(newest=state)
                except BaseException:
                    self._entries = entries
                    raise
            self._nonfloat = {
                k: v.detach().to("cpu", copy=True) for k, v in state.items() if k not in self._spec
            }
            self.updates += 1

    def _check_keys(self, state: Mapping[str, torch.Tensor], tokens: int) -> None:
        if not self._spec:
            self._spec = {
                k: (tuple(v.shape), v.dtype)
                for k, v in state.items()
                if self.policy.averaged(k, v.dtype, v.shape)
            }
            if not self._spec:
                raise PmakitError("the state has no floating-point tensors to average")
            return
        floats = {k for k, v in state.items() if self.policy.averaged(k, v.dtype, v.shape)}
        missing, extra = self._spec.keys() - floats, floats - self._spec.keys()
        wrong = [k for k in self._spec.keys() & floats if tuple(state[k].shape) != self._spec[k][0]]
        if missing or extra or wrong:
            raise PmakitError(
                f"the snapshot at {tokens} tokens does not match the window: missing {sorted(missing)[:5]}, "
                f"extra {sorted(extra)[:5]}, other shape {sorted(wrong)[:5]}"
            )

    def _slide(self, new: _Entry, state: Mapping[str, torch.Tensor]) -> None:
        """Fold ``new`` into the running sums by the identities of the module docstring."""
        m, n, a = len(self._entries), self.n, self.alpha
        dropped = self._entries[0] if m == n else None
        # After the slide the oldest is the old second one, or the new snapshot itself when N = 1.
        new_oldest = (self._entries[1] if m > 1 else new) if dropped is not None else None
        with contextlib.ExitStack() as stack:
            read_dropped = self._source(dropped, stack) if dropped is not None else None
            read_oldest = None
            assert self._running is not None
            second = any("second" in terms for terms in self._running.step(m, n, a).values())
            if second and new_oldest is not None:
                read_oldest = self._source(new_oldest, stack) if new_oldest is not new else None
            if m == 0:
                self._sums = {name: {} for name in accumulator_coefficients(self.method, 1, a)}
            try:
                self._fold(state, read_dropped, read_oldest)
            except BaseException:
                self._recover()  # the sums may be half updated
                raise
        self._entries = [*self._entries, new][-n:]

    def _fold(
        self,
        state: Mapping[str, torch.Tensor],
        read_dropped: _Read | None,
        read_oldest: _Read | None,
    ) -> None:
        """Add the new snapshot ``state`` to the sums and subtract what leaves (the weighting's ``RunningSums.step``);
        the window is not moved yet."""
        m, n, a = len(self._entries), self.n, self.alpha
        assert self._running is not None
        steps = self._running.step(m, n, a)
        for k in self._spec:
            x = state[k].detach().to("cpu")
            if m == 0:
                self._init_sums(k, x)
                continue
            old = read_dropped(k) if read_dropped is not None else None
            snapshots = {"new": x, "dropped": old}
            for name, terms in steps.items():
                s = self._sums[name][k]
                if terms.get(name, 1.0) != 1.0:
                    s.mul_(terms[name])
                for term, c in terms.items():
                    src: torch.Tensor | None
                    if term == name:
                        continue
                    if term == "second":
                        src = read_oldest(k) if read_oldest is not None else x
                    else:
                        src = self._sums[term][k] if term in self._sums else snapshots[term]
                    assert src is not None, f"{term} is not known while adding a snapshot to a window of {m}"
                    axpy(s, src, c)

    def _recover(self) -> None:
        """After a failed slide the sums may be half updated: recompute them for the old window, or empty it."""
        try:
            self._rebuild()
        except Exception:
            log.exception("could not rebuild the running average; it restarts empty")
            self._entries, self._sums = [], {}

    def _init_sums(self, key: str, x: torch.Tensor) -> None:
        for name, coefficients in accumulator_coefficients(self.method, 1, self.alpha).items():
            self._sums[name][key] = x.to(torch.float32, copy=True).mul_(coefficients[0])

    def _rebuild(self, newest: Mapping[str, torch.Tensor] | None = None) -> None:
        """Recompute the running sums from the window's snapshots (``newest``: the last one's tensors, in hand)."""
        m = len(self._entries)
        coefficients = accumulator_coefficients(self.method, m, self.alpha)
        sums: dict[str, dict[str, torch.Tensor]] = {name: {} for name in coefficients}
        with contextlib.ExitStack() as stack:
            sources = [self._source(e, stack) for e in self._entries[: m - 1 if newest is not None else m]]
            for k in self._spec:
                for i in range(m):
                    if i < len(sources):
                        x = sources[i](k)
                    else:
                        assert newest is not None
                        x = newest[k].detach()
                    x = x.to("cpu")
                    for name, c in coefficients.items():
                        if i == 0:
                            sums[name][k] = x.to(torch.float32, copy=True).mul_(c[0])
                        else:
                            axpy(sums[name][k], x, c[i])
        self._sums = sums
        self._since_resum = 0

    def _source(self, entry: _Entry, stack: contextlib.ExitStack) -> _Read:
        """A function key -> that snapshot's tensor (its own dtype), from memory or from its directory."""
        if entry.held is not None:
            held = entry.held
            return lambda k: held[k]
        if entry.path is None:
            raise PmakitError(f"the snapshot at {entry.tokens} tokens has no path and is not held in memory")
        reader = stack.enter_context(_open_window_snapshot(entry))
        for k, (shape, _) in self._spec.items():
            info = reader.tensors.get(k)
            if info is None or tuple(info.shape) != shape:
                raise PmakitError(
                    f"{entry.path}: tensor {k!r} is missing or has another shape than the window's"
                )

        def read(k: str) -> torch.Tensor:
            return reader.read(k, 0, reader.tensors[k].numel).view(self._spec[k][0])

        return read

    def rebuild_from(self, snapshots: Sequence[Snapshot]) -> None:
        """Set the window to the last N of ``snapshots`` (oldest first) and compute the sums from their files."""
        with self._lock:
            chosen = list(snapshots)[-self.n :]
            if not chosen:
                self._entries, self._sums, self._spec, self._nonfloat = [], {}, {}, {}
                return
            self._entries = [_Entry(s.tokens, s.path) for s in chosen]
            with open_reader(chosen[-1].path) as newest:
                self._spec = {
                    k: (tuple(info.shape), info.dtype)
                    for k, info in newest.tensors.items()
                    if self.policy.averaged(k, info.dtype, info.shape)
                }
                self._nonfloat = {
                    k: newest.read(k, 0, info.numel).view(info.shape).clone()
                    for k, info in newest.tensors.items()
                    if not self.policy.averaged(k, info.dtype, info.shape)
                }
            if self.hold_in_memory:
                for e in self._entries:
                    with _open_window_snapshot(e) as reader:
                        e.held = {
                            k: reader.read(k, 0, reader.tensors[k].numel).view(s).clone()
                            for k, (s, _) in self._spec.items()
                        }
            self._rebuild()

    # -- the average --------------------------------------------------------------------------------------------

    def _average_tensor(self, key: str) -> torch.Tensor:
        """The fp32 average of one tensor (a new tensor)."""
        name, factor = _average_factor(self.method, len(self._entries), self.alpha)
        return self._sums[name][key] * factor

    def average(self) -> dict[str, torch.Tensor]:
        """The average of the window: averaged tensors in fp32, the others the newest snapshot's (router biases in fp32,
        as the offline merge writes them)."""
        with self._lock:
            if not self._entries:
                raise PmakitError("the averager has no snapshot yet")
            out = {k: self._average_tensor(k) for k in self._spec}
            out.update(
                {
                    k: v.to(self.policy.out_dtype(k, v.dtype, v.shape), copy=True)
                    for k, v in self._nonfloat.items()
                }
            )
            return out

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block, ``model``'s floating-point weights are the average (cast to their dtype).

        The original weights are kept on the CPU and copied back in ``finally``, bit for bit, even when the block
        raises. Router biases taken from the newest snapshot (``buffers="latest"``) are that snapshot's; counters
        and other non-float buffers stay as they are. Tied weights are written once.
        """
        backup: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            # The lock covers the copy only: an update during the block changes the sums, not the model.
            with self._lock, torch.no_grad():
                if not self._entries:
                    raise PmakitError("the averager has no snapshot yet")
                for key, t in self._targets(model):
                    backup.append((t, t.detach().to("cpu", copy=True)))
                    t.copy_(self._average_tensor(key) if key in self._spec else self._nonfloat[key])
            yield model
        finally:
            with torch.no_grad():
                for t, saved in backup:
                    t.copy_(saved)

    def _targets(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(average key, the model's tensor) for every averaged tensor and every float tensor taken from the newest
        snapshot, each storage once."""
        targets = []
        covered = set()
        seen = set()
        for name, t in model.state_dict(keep_vars=True).items():
            key = alias_key(t)
            if key in seen:
                covered.add(name)
                continue
            seen.add(key)
            if name in self._spec:
                if tuple(t.shape) != self._spec[name][0]:
                    raise PmakitError(
                        f"model tensor {name!r} has shape {list(t.shape)}, the average {list(self._spec[name][0])}"
                    )
                targets.append((name, t.data))
                covered.add(name)
            elif name in self._nonfloat and self.policy.kind(name, t.dtype, t.shape) is Kind.ROUTER_BIAS:
                targets.append((name, t.data))  # the newest snapshot's (buffers="latest")
        missing = [k for k in self._spec if k not in covered]
        if missing:
            raise PmakitError(
                f"the model has no tensors named {missing[:5]} (of the average's {len(self._spec)})"
            )
        return targets

    # -- resuming -----------------------------------------------------------------------------------------------

    def state_dict(self, *, include_tensors: bool | None = None) -> dict[str, Any]:
        """The window and how to continue it.

        Args:
            include_tensors: store the running sums (and held snapshots) themselves, so that a resumed run
                continues bit for bit. By default only when some snapshot of the window has no path; otherwise the
                state is small and ``load_state_dict`` rebuilds the sums from the window's files (N reads, equal
                to the running sums to fp32 rounding).
        """
        with self._lock:
            if include_tensors is None:
                include_tensors = any(e.path is None for e in self._entries)
            state: dict[str, Any] = {
                "version": STATE_VERSION,
                "method": self.method,
                "n": self.n,
                "alpha": self.alpha,
                "buffers": self.policy.buffers,
                "hold_in_memory": self.hold_in_memory,
                "updates": self.updates,
                "since_resum": self._since_resum,
                "window": [[e.tokens, None if e.path is None else str(e.path)] for e in self._entries],
            }
            if include_tensors:
                state["tensors"] = {
                    "sums": {name: dict(s) for name, s in self._sums.items()},
                    "held": [e.held for e in self._entries],
                    "nonfloat": dict(self._nonfloat),
                    "spec": {
                        k: [list(shape), str(dtype).replace("torch.", "")]
                        for k, (shape, dtype) in self._spec.items()
                    },
                }
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the window of ``state``. A different method, N, alpha or buffers rule rebuilds the sums from the
        files."""
        with self._lock:
            entries = [_Entry(int(t), None if p is None else Path(p)) for t, p in state["window"]]
            same = (state["method"], state["n"], state["alpha"], state.get("buffers", DEFAULT_BUFFERS)) == (
                self.method,
                self.n,
                self.alpha,
                self.policy.buffers,
            )
            tensors = state.get("tensors")
            self.updates = int(state.get("updates", len(entries)))
            if tensors is not None and same:
                self._entries = entries
                self._sums = {name: dict(s) for name, s in tensors["sums"].items()}
                self._nonfloat = dict(tensors["nonfloat"])
                self._spec = {
                    k: (tuple(shape), getattr(torch, dt)) for k, (shape, dt) in tensors["spec"].items()
                }
                held = tensors["held"]
                for e, h in zip(self._entries, held):
                    e.held = h
                if self.hold_in_memory and any(e.held is None for e in self._entries):
                    self.rebuild_from(
                        [Snapshot(e.path, e.tokens) for e in self._entries if e.path is not None]
                    )
                self._since_resum = int(state.get("since_resum", 0))
                return
            if any(e.path is None for e in entries):
                raise PmakitError(
                    "cannot rebuild the averager: its state holds no running sums and some snapshots of its "
                    "window have no path"
                )
            assert all(e.path is not None for e in entries)
            self.rebuild_from([Snapshot(e.path, e.tokens) for e in entries])  # type: ignore[arg-type]


AXPY_CHUNK = 2**20
"""Elements per step of ``axpy``: bounds the fp32 temporary torch makes of a bf16/fp16 operand to 4 MiB."""


def axpy(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0) -> None:
    """``dst += alpha * src`` in place (dst fp32, contiguous), a chunk at a time.

    A CPU op on mixed dtypes first casts the whole operand to fp32: a model-sized tensor would cost a temporary as
    large as itself (glibc then keeps such blocks in the heap). Chunks keep it to 4 MiB; the values are the same.
    """
    d, s = dst.view(-1), src.reshape(-1)
    if s.dtype == dst.dtype or d.numel() <= AXPY_CHUNK:
        d.add_(s, alpha=alpha)
        return
    for i in range(0, d.numel(), AXPY_CHUNK):
        d[i : i + AXPY_CHUNK].add_(s[i : i + AXPY_CHUNK], alpha=alpha)


@contextlib.contextmanager
def _open_window_snapshot(entry: _Entry) -> Iterator[Reader]:
    """Open a window snapshot's weights, checking its metadata still says the window's token count."""
    assert entry.path is not None
    try:
        snapshot = read_snapshot(entry.path)
    except IncompleteSnapshot as e:
        raise PmakitError(
            f"the averaging window needs {entry.path} ({entry.tokens} tokens), which is incomplete: {e} "
            "(a keep_last below N deletes snapshots the averager still reads; or use hold_in_memory=True)"
        ) from e
    except PmakitError as e:
        raise PmakitError(
            f"the averaging window needs {entry.path} ({entry.tokens} tokens), which is gone: {e} "
            "(a keep_last below N deletes snapshots the averager still reads; or use hold_in_memory=True)"
        ) from e
    if snapshot.tokens != entry.tokens:
        raise PmakitError(
            f"{entry.path} now holds the snapshot at {snapshot.tokens} tokens, not the window's {entry.tokens}"
        )
    with open_reader(entry.path) as reader:
        yield reader
