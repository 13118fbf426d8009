"""``--format safetensors`` for torchtitan inputs: HF names through torchtitan's own state-dict adapter.

torchtitan's HF load path (``--checkpoint.initial_load_in_hf``) reads HF-named safetensors and converts them with the
model's ``ModelSpec.state_dict_adapter.from_hf``; this writer applies the inverse, ``to_hf`` (llama3: renames, and
the rotary permutation of ``wq``/``wk``, which needs the model's head counts). The adapter needs torchtitan
installed and the model's config, which a checkpoint does not hold: it is rebuilt from the job config torchtitan
writes with ``--debug.save_config_file NAME.json`` (``model_spec.name`` and ``flavor``, i.e. ``--module`` and the
registry flavor), looked for in the dump folder (two levels above ``checkpoint/step-N``). Without torchtitan, that
file, or an adapter for the model, ``--format safetensors`` writes torchtitan's own names (a warning says why);
``--format torchtitan-hf`` asks for HF names explicitly and fails instead.

What the adapter drops (gpt_oss's routed experts, qwen3's and gpt_oss's ``expert_bias_E``) is routed by
``torchtitan_names``; the conversion is checked complete before writing and the written header read back (names,
count, bytes): a conversion that would lose a tensor fails in one line. ``LastSaveReader`` reads torchtitan's own
last save in HF format (``--checkpoint.last_save_in_hf``) back under torchtitan's names along the same routes.

Memory: tensors are converted and written one at a time (``to_hf`` on a one-entry state dict), so at most one
converted tensor is held. Under torchrun each rank writes its own file (``model-hf-R-of-N.safetensors``, no
index: torchtitan's HF reader reads every ``*.safetensors`` file of the directory).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import Reader, TensorInfo, open_reader
from pmakit.formats.safetensors_io import OutputTensor, Shard, ShardWriter
from pmakit.layouts import torchtitan_names as names
from pmakit.layouts.base import Layout, Snapshot

NAME = "torchtitan-hf"


def job_config(checkpoint: Path) -> dict[str, Any] | None:
    """torchtitan's saved job config (``--debug.save_config_file``) in the dump folder of ``checkpoint``."""
    dump = checkpoint.absolute().parent.parent  # the save folder named, symlinks not followed
    for file in sorted(dump.glob("*.json")) + sorted(dump.glob("*/*.json")):
        try:
            if file.stat().st_size > 2**22:
                continue
            data = limits.read_json(file)  # a FIFO or a deeply nested file is not a job config: skipped
        except (OSError, PmakitError):
            continue
        spec = data.get("model_spec") if isinstance(data, dict) else None
        if (
            isinstance(spec, dict)
            and isinstance(spec.get("name"), str)
            and isinstance(spec.get("flavor"), str)
        ):
            return data
    return None


@functools.cache
def _adapter(name: str, flavor: str) -> Any:
    """torchtitan's state-dict adapter for ``--module name`` and registry flavor ``flavor``."""
    module = importlib.import_module(f"torchtitan.models.{name}")
    spec = module.model_registry(flavor)
    if spec.state_dict_adapter is None:
        raise PmakitError(f"torchtitan's {name} model ships no state-dict adapter")
    return spec.state_dict_adapter(spec.model, None)


def adapter_for(checkpoint: Path) -> tuple[Any, str, str]:
    """(the adapter, the model's ``--module`` name, '') or (None, '', why not)."""
    config = job_config(checkpoint)
    if config is None:
        return (
            None,
            "",
            f"no torchtitan job config in {checkpoint.absolute().parent.parent} "
            "(run torchtitan with --debug.save_config_file config.json)",
        )
    spec = config["model_spec"]
    try:
        return _adapter(spec["name"], spec["flavor"]), spec["name"], ""
    except (ImportError, AttributeError, KeyError, PmakitError) as e:
        return None, "", f"no torchtitan state-dict adapter for {spec['name']}/{spec['flavor']} ({e})"


def export_format(snapshot: Snapshot) -> str:
    """``torchtitan-hf`` when the adapter for ``snapshot``'s model is at hand, else ``safetensors`` (warned)."""
    adapter, _, why = adapter_for(snapshot.path)
    if adapter is None:
        print(f"warning: --format safetensors keeps torchtitan's parameter names: {why}", file=sys.stderr)
        return "safetensors"
    return NAME


def plan_routes(adapter: Any, family: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, names.Route]:
    """Each tensor's HF route, checked to lose nothing (``names.check_complete``)."""
    routes = {name: names.route(adapter, family, name, shape) for name, shape in shapes.items()}
    names.check_complete(routes, shapes)
    return routes


def _check_written(path: Path, planned: list[OutputTensor]) -> None:
    """Read the written file's header back: the planned names, count and bytes, or one line saying what is not."""
    from pmakit.formats.safetensors_io import read_header

    header, _, _ = read_header(path)
    got = {k: v for k, v in header.items() if k != "__metadata__"}
    want = {t.name: t for t in planned}
    if got.keys() != want.keys():
        lost = sorted(want.keys() - got.keys()) or sorted(got.keys() - want.keys())
        raise PmakitError(
            f"{path}: holds {len(got)} of {len(want)} converted tensors (e.g. {lost[0]!r} differs)"
        )
    size = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in got.values())
    if size != sum(t.nbytes for t in planned):
        raise PmakitError(f"{path}: {size} bytes of tensors, {sum(t.nbytes for t in planned)} converted")


LAST_SAVE = "--checkpoint.last_save_in_hf"


class LastSaveReader(Reader):
    """torchtitan's last save in HF format (``--checkpoint.last_save_in_hf``: ``step-N/`` of HF safetensors) under
    torchtitan's names, so that it merges with the run's DCP checkpoints: each tensor read back along its route
    (``torchtitan_names``), one converted tensor held at a time. The names and shapes are those of ``reference``,
    a DCP checkpoint of the same run; a save that lacks any of them is refused in one line, never merged short."""

    format = "torchtitan-hf"

    def __init__(self, path: Path, reference: Mapping[str, TensorInfo]) -> None:
        super().__init__(path)
        adapter, family, why = adapter_for(path)
        if adapter is None:
            raise PmakitError(f"{path}: torchtitan's last save in HF format ({LAST_SAVE}); to read it: {why}")
        self.adapter, self.inner = adapter, open_reader(path)
        self.files, self.skipped = self.inner.files, self.inner.skipped
        shapes = {n: i.shape for n, i in reference.items()}
        self.routes = plan_routes(adapter, family, shapes)
        held = self.inner.tensors
        lacking = [n for n, r in self.routes.items() if any(h not in held for h in r.hf)]
        if lacking:
            raise PmakitError(
                f"{path} is torchtitan's last save in HF format ({LAST_SAVE}) and lacks {len(lacking)} of the "
                f"run's {len(shapes)} tensors (e.g. {lacking[0]!r}, which torchtitan's {family} adapter does not "
                f"write): merge without it (--exclude {path}), or train without {LAST_SAVE}"
            )
        used = {h for r in self.routes.values() for h in r.hf}
        for n, r in self.routes.items():
            for h, shape in zip(r.hf, r.shapes):
                if held[h].shape != shape:
                    raise PmakitError(f"{path}: {h!r} is {list(held[h].shape)}, {list(shape)} for {n!r}")
        if len(used) != len(held):
            extra = sorted(held.keys() - used)
            raise PmakitError(f"{path}: {len(extra)} tensors the run's checkpoints lack, e.g. {extra[0]!r}")
        self.tensors = {
            n: TensorInfo(held[r.hf[0]].dtype, shapes[n], held[r.hf[0]].order) for n, r in self.routes.items()
        }
        self._cached: tuple[str, torch.Tensor] | None = None

    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._cached is None or self._cached[0] != name:
            r = self.routes[name]
            parts = [
                self.inner.read(h, 0, self.inner.tensors[h].numel).reshape(shape)
                for h, shape in zip(r.hf, r.shapes)
            ]
            value = names.from_hf(self.adapter, r, name, parts)
            self._cached = (name, value.contiguous().reshape(-1))
        return self._cached[1][start:stop]

    def verify(self) -> None:
        self.inner.verify()

    def close(self) -> None:
        self._cached = None
        self.inner.close()


class TorchtitanHFExport(Layout):
    """Writes merged torchtitan weights as HF safetensors; never claims a checkpoint itself."""

    name = NAME

    def is_snapshot(self, path: Path) -> bool:
        return False

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        raise PmakitError(f"{path}: {NAME} is an output format only")

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        adapter, family, why = adapter_for(template)
        if adapter is None:
            raise PmakitError(f"cannot write HF names: {why}; use --format safetensors")
        order = sorted(merged)
        routes = plan_routes(adapter, family, {n: tuple(merged[n].shape) for n in order})
        planned = [
            OutputTensor(k, merged[n].dtype, shape)
            for n in order
            for k, shape in zip(routes[n].hf, routes[n].shapes)
        ]
        rank, world = (
            (torch.distributed.get_rank(), torch.distributed.get_world_size()) if distributed else (0, 1)
        )
        # Not the staged shards' names (model.safetensors, model-0000i-of-0000n...): they are read while this writes.
        file = "model-hf.safetensors" if world == 1 else f"model-hf-{rank + 1:05d}-of-{world:05d}.safetensors"
        writer = ShardWriter(out / file, Shard(file, tuple(planned)))
        try:
            for n in order:
                for k, v in names.to_hf(adapter, routes[n], n, merged[n]):
                    writer.write(k, v.contiguous().reshape(-1))
            writer.close(fsync=fsync)
        except BaseException:
            writer.abort()
            raise
        _check_written(out / file, planned)
        # No index: the merge drops the staged shards' index after this, and torchtitan's HF reader
        # (HuggingFaceStorageReader) reads every *.safetensors file of the directory.
        if distributed:
            everyone: list[Any] = [None] * world
            torch.distributed.all_gather_object(everyone, file)
            return everyone if rank == 0 else []
        return [file]


LAYOUT = TorchtitanHFExport()
