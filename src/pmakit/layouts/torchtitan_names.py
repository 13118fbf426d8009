"""torchtitan's parameter names <-> HF names, tensor by tensor, losing nothing: the ``--format safetensors`` writer
(``torchtitan_hf``) and the reader of torchtitan's last save in HF format (``--checkpoint.last_save_in_hf``) share it.

torchtitan's state-dict adapters (``ModelSpec.state_dict_adapter``) skip what they cannot map, silently: in 0.3.0
gpt_oss's routed experts (``mlp1_weight_EGD``, ``mlp1_bias_EG``, ``mlp2_weight_EDF``, ``mlp2_bias_ED``: its map
names ``mlp1_weight``, the MXFP4 checkpoint's ``gate_up_proj_blocks``) and every router's ``expert_bias_E`` of
qwen3 and gpt_oss (their HF models have no such bias). Each torchtitan tensor gets a ``Route`` instead:

- ``adapter``: the adapter's own ``to_hf``/``from_hf`` on that one tensor (renames, llama3's rotary permutation);
- ``experts``: a grouped ``[E, ...]`` expert tensor (qwen3, deepseek_v3, kimi_k2_7) as E tensors under the adapter's
  per-expert names (``model.layers.1.mlp.experts.{e}.gate_proj.weight``), split by the tensor's own first
  dimension, not the model config's expert count;
- ``gpt_oss``: gpt_oss's grouped experts under transformers' unquantized ``GptOssExperts`` names:
  ``mlp.experts.gate_up_proj`` [E, D, 2F] (``mlp1_weight_EGD`` transposed; gate and up interleaved in both),
  ``gate_up_proj_bias``, ``down_proj`` [E, F, D] (``mlp2_weight_EDF`` transposed), ``down_proj_bias``;
- ``extra``: no HF name (the HF model has no slot, e.g. qwen3's and gpt_oss's ``expert_bias_E``): kept under
  ``torchtitan.<its torchtitan name>`` (transformers reports it as an unexpected key and leaves it out of its
  model, whose router has no bias; torchtitan's HF reader asks for HF names only and leaves it at its initial
  value: load the native output to resume with it).

``check_complete`` proves a conversion lost nothing: every torchtitan name routed, the HF names distinct, and as
many elements out as in.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pmakit.errors import PmakitError

EXTRA = "torchtitan."
"""The prefix of a tensor HF has no name for: ``torchtitan.layers.1.moe.expert_bias_E``."""
_GROUPED = re.compile(r"\.moe\.routed_experts\.inner_experts\.\w+$")
_GPT_OSS = {
    "mlp1_weight_EGD": ("gate_up_proj", True),
    "mlp1_bias_EG": ("gate_up_proj_bias", False),
    "mlp2_weight_EDF": ("down_proj", True),
    "mlp2_bias_ED": ("down_proj_bias", False),
}
"""gpt_oss's grouped expert tensors -> (transformers' name under ``model.layers.N.mlp.experts.``, transposed)."""


@dataclass(frozen=True)
class Route:
    """How one torchtitan tensor is stored under HF names."""

    kind: str
    """``adapter``, ``experts``, ``gpt_oss`` or ``extra`` (see the module docstring)."""
    hf: tuple[str, ...]
    """The HF names it becomes (E of them for ``experts``)."""
    shapes: tuple[tuple[int, ...], ...]
    """Their shapes."""


def _layer(name: str) -> str:
    found = re.search(r"\d+", name)
    return found.group(0) if found else ""


def route(adapter: Any, family: str, name: str, shape: tuple[int, ...]) -> Route:
    """The route of torchtitan tensor ``name`` of ``shape`` for ``adapter`` (of model ``family``, ``--module``)."""
    leaf = name.rsplit(".", 1)[-1]
    if _GROUPED.search(name) and family == "gpt_oss" and leaf in _GPT_OSS:
        hf_leaf, transposed = _GPT_OSS[leaf]
        out = (shape[0], shape[2], shape[1]) if transposed else shape
        return Route("gpt_oss", (f"model.layers.{_layer(name)}.mlp.experts.{hf_leaf}",), (out,))
    if _GROUPED.search(name):
        abstract = re.sub(r"(\d+)", "{}", name, count=1)
        to_hf = {v: k for k, v in getattr(adapter, "from_hf_map", {}).items() if v is not None}
        pattern = to_hf.get(abstract)
        if pattern is not None and pattern.count("{}") == 2 and len(shape) >= 2:
            names = tuple(pattern.format(_layer(name), e) for e in range(shape[0]))
            return Route("experts", names, (shape[1:],) * shape[0])
    try:
        out = adapter.to_hf({name: torch.empty(shape, device="meta")})
    except Exception as e:  # an adapter's own failure on one tensor: that tensor's route is unknown
        raise PmakitError(
            f"torchtitan's {family} adapter cannot convert {name!r} ({type(e).__name__}: {e})"
        ) from e
    if not out:
        return Route("extra", (EXTRA + name,), (shape,))
    return Route("adapter", tuple(out), tuple(tuple(v.shape) for v in out.values()))


def to_hf(adapter: Any, r: Route, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of torchtitan tensor ``name`` along route ``r``."""
    if r.kind == "experts":
        yield from zip(r.hf, tensor.unbind(0))
    elif r.kind == "gpt_oss":
        yield r.hf[0], tensor.transpose(1, 2) if tensor.dim() == 3 else tensor
    elif r.kind == "extra":
        yield r.hf[0], tensor
    else:
        got = adapter.to_hf({name: tensor})
        if tuple(got) != r.hf:
            raise PmakitError(f"torchtitan's adapter converted {name!r} to {list(got)}, planned {list(r.hf)}")
        yield from got.items()


def from_hf(adapter: Any, r: Route, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Torchtitan tensor ``name`` back from its HF tensors ``parts`` (in ``r.hf``'s order)."""
    if r.kind == "experts":
        return torch.stack(parts)
    if r.kind == "gpt_oss":
        return parts[0].transpose(1, 2) if parts[0].dim() == 3 else parts[0]
    if r.kind == "extra":
        return parts[0]
    got = adapter.from_hf(dict(zip(r.hf, parts)))
    if name not in got:
        raise PmakitError(f"torchtitan's adapter converts {list(r.hf)} to {list(got)}, not {name!r}")
    return torch.as_tensor(got[name])


def check_complete(routes: Mapping[str, Route], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every torchtitan tensor routed, HF names distinct, elements kept: else one line saying what would be lost."""
    missing = [n for n in shapes if n not in routes or not routes[n].hf]
    if missing:
        raise PmakitError(f"{len(missing)} of {len(shapes)} tensors have no HF name, e.g. {missing[0]!r}")
    seen: dict[str, str] = {}
    for name, r in routes.items():
        for hf in r.hf:
            if hf in seen:
                raise PmakitError(f"{name!r} and {seen[hf]!r} would both be written as {hf!r}")
            seen[hf] = name
        numel_in, numel_out = _numel(shapes[name]), sum(_numel(s) for s in r.shapes)
        if numel_in != numel_out:
            raise PmakitError(f"{name!r} has {numel_in} elements but its HF tensors {list(r.hf)} {numel_out}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
