"""What kind of state a tensor is, decided once by its name and dtype, and the rule a merge applies to each kind.

Kinds (``Kind``):

- ``weight``: a parameter. Averaged with the merge's weights, written in ``--dtype``.
- ``router_bias``: an MoE router's load-balancing bias, a buffer the trainer updates outside the optimizer
  (auxiliary-loss-free balancing). Averaged by default, or the newest snapshot's with ``buffers="latest"``; always
  accumulated and written in fp32 whatever ``--dtype`` says (a bias rounded to bf16 changes which experts win).
- ``counter``: a count (tokens routed to each expert) or any other non-float tensor. The newest snapshot's, as it
  is, never averaged: an average of counts is a count of nothing.

A name is not enough: every framework's router bias and counter is one number per expert (1-D; a counter may be
a 0-D scalar). A float tensor whose name looks like router state but whose shape does not is a weight, averaged
and cast like one, with one warning naming it (a model's own ``tokens_per_expert`` projection is not a count).

RNG states and a module's extra state are not tensors of the model and never reach a merge plan: the layouts skip
them (``Reader.skipped``). Names are matched as suffixes of the full tensor name, so that the same pattern finds a
tensor whatever prefix (``model.``, ``module.``, ``decoder.layers.3.``) a trainer puts before it.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pmakit.errors import PmakitError
from pmakit.formats import is_float


class Kind(str, enum.Enum):
    WEIGHT = "weight"
    ROUTER_BIAS = "router_bias"
    COUNTER = "counter"


BUFFER_RULES = ("average", "latest")
"""What a merge does with router biases: average them like the weights, or take the newest snapshot's."""
DEFAULT_BUFFERS = "average"
"""The default rule for router biases: the averaged router's bias is the same time-average as the router weights
it steers (docs/moe.md argues it)."""

PATTERNS: dict[str, tuple[tuple[str, Kind], ...]] = {
    # megatron.core.transformer.moe.router: the bias is persistent; the counters are not (listed for the
    # checkpoints of versions or forks that save them).
    "megatron": (
        (r"(^|\.)router\.expert_bias$", Kind.ROUTER_BIAS),
        (r"(^|\.)router\.(local|global)_tokens_per_expert$", Kind.COUNTER),
        (r"(^|\.)router\.ga_steps$", Kind.COUNTER),
    ),
    # torchtitan.models.common.moe (0.3.0: the ``_E`` suffix names the experts dimension; older: none).
    "torchtitan": (
        (r"(^|\.)expert_bias(_E)?$", Kind.ROUTER_BIAS),
        (r"(^|\.)tokens_per_expert(_E)?$", Kind.COUNTER),
    ),
    # olmo_core.nn.moe.router (and moe.v2.router).
    "olmo-core": (
        (r"(^|\.)router\.score_bias$", Kind.ROUTER_BIAS),
        (r"(^|\.)router\.batch_size_per_expert$", Kind.COUNTER),
    ),
    # transformers: DeepSeek-V3 and the models that copy its router (GLM-4 MoE, Kimi, Dots, ...). Qwen2/3-MoE,
    # OLMoE and Mixtral have no bias: their routers are plain weights.
    "hf": ((r"(^|\.)e_score_correction_bias$", Kind.ROUTER_BIAS),),
}
"""Per framework: name patterns (regular expressions searched in the full name) and the kind they mark."""

_COMPILED = [(re.compile(p), kind) for patterns in PATTERNS.values() for p, kind in patterns]

MAX_DIMS = {Kind.ROUTER_BIAS: (1, 1), Kind.COUNTER: (0, 1)}
"""The dimensions (least, most) a float tensor named like router state must have to be taken for it; one more
where the layers are stacked on a leading dimension (Megatron's ``decoder.layers.mlp.router.expert_bias``: no layer
index in the name, one row per layer)."""
_STACKED = re.compile(r"(^|\.)layers\.(?!\d)")

log = logging.getLogger(__name__)
_warned: set[str] = set()


def classify(name: str, dtype: torch.dtype, shape: Sequence[int]) -> Kind:
    """The kind of the tensor ``name`` of ``dtype`` and ``shape``: non-float tensors are counters, float ones by
    their name, when their shape is one router state can have (else a weight, with one warning)."""
    if not is_float(dtype):
        return Kind.COUNTER
    for pattern, kind in _COMPILED:
        if pattern.search(name):
            least, most = MAX_DIMS[kind]
            if least <= len(shape) <= most + bool(_STACKED.search(name)):
                return kind
            if name not in _warned:
                _warned.add(name)
                log.warning("%s is named like a %s but is a %s tensor of shape %s: merged as a weight", name,
                            kind.value.replace("_", " "), str(dtype).removeprefix("torch."), list(shape))  # fmt: skip
            return Kind.WEIGHT
    return Kind.WEIGHT


def rule(kind: Kind, buffers: str = DEFAULT_BUFFERS) -> str:
    """What a merge does with a tensor of ``kind``: ``average`` or ``latest`` (the newest snapshot's, as it is)."""
    if kind is Kind.WEIGHT:
        return "average"
    if kind is Kind.COUNTER:
        return "latest"
    return buffers


DTYPES: dict[str, torch.dtype] = {
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16"), torch.float16),
    **dict.fromkeys(("fp32", "float32"), torch.float32),
}
"""Output dtypes by name (``--dtype``)."""


def output_dtype(dtype: str | torch.dtype | None, source: torch.dtype) -> torch.dtype:
    """The dtype a tensor is written in: ``same`` keeps the input's; non-float tensors always keep theirs."""
    if not is_float(source) or dtype in (None, "same"):
        return source
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PmakitError(f"unknown --dtype {dtype!r}; use same, bf16, fp16 or fp32")
    return DTYPES[dtype]


@dataclass(frozen=True)
class TensorPolicy:
    """What every merge does with each tensor, by its kind: the rule and the output dtype.

    One policy serves the streaming merge (``MergePlan.policy``), ``average_states``, the incremental merge and
    ``OnlineAverager``, so that an online average and an offline merge of the same snapshots agree: weights are
    averaged and written in ``dtype``; router biases are averaged or the newest snapshot's (``buffers``), in fp32
    whatever ``dtype``; counters are the newest snapshot's, as they are.
    """

    buffers: str = DEFAULT_BUFFERS
    """The rule for router biases: ``average`` or ``latest``."""
    dtype: str | torch.dtype | None = "same"
    """The weights' output dtype: ``same`` (each its input's), a name of ``DTYPES`` or a torch dtype."""

    def __post_init__(self) -> None:
        check_buffers(self.buffers)

    def kind(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> Kind:
        return classify(name, dtype, shape)

    def rule(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> str:
        """``average`` (the weighted fp32 sum of the inputs) or ``latest`` (the newest input's, as it is)."""
        return self.rule_of(classify(name, dtype, shape))

    def rule_of(self, kind: Kind) -> str:
        return rule(kind, self.buffers)

    def averaged(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> bool:
        return self.rule(name, dtype, shape) == "average"

    def out_dtype(self, name: str, source: torch.dtype, shape: Sequence[int]) -> torch.dtype:
        """The output dtype of the tensor ``name`` stored as ``source`` in ``shape``."""
        return kind_dtype(classify(name, source, shape), self.dtype, source)


def kind_dtype(kind: Kind, dtype: str | torch.dtype | None, source: torch.dtype) -> torch.dtype:
    """A weight's output dtype is ``dtype``; a router bias is fp32 whatever ``dtype`` (rounding it moves the
    routing), a counter keeps its own."""
    if kind is Kind.ROUTER_BIAS:
        output_dtype(dtype, source)  # still reject an unknown dtype
        return torch.float32
    if kind is Kind.COUNTER:
        return source
    return output_dtype(dtype, source)


def check_buffers(buffers: str) -> str:
    """``buffers`` if it is a known rule, else a one-line error."""
    if buffers not in BUFFER_RULES:
        raise PmakitError(f"unknown buffers rule {buffers!r}; use {' or '.join(BUFFER_RULES)}")
    return buffers


def listing(kinds: Mapping[str, Kind], buffers: str) -> dict[str, dict[str, object]]:
    """The non-weight state of a model, by kind: the names and the rule applied (for the manifest and inspect)."""
    out: dict[str, dict[str, object]] = {}
    for name, kind in kinds.items():
        if kind is not Kind.WEIGHT:
            entry = out.setdefault(kind.value, {"rule": rule(kind, buffers), "names": []})
            names = entry["names"]
            assert isinstance(names, list)
            names.append(name)
    if Kind.ROUTER_BIAS.value in out:
        out[Kind.ROUTER_BIAS.value]["dtype"] = "float32"
    return out


def describe(state: Mapping[str, Mapping[str, object]]) -> list[str]:
    """``listing``'s result as lines for a terminal: the kind, how many tensors, the rule, a few names."""
    lines = []
    for kind, entry in state.items():
        names = entry["names"]
        assert isinstance(names, list)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        rule_text = "averaged" if entry["rule"] == "average" else "from the newest snapshot"
        dtype = " in float32" if "dtype" in entry else ""
        lines.append(f"{kind}: {len(names)} tensor(s), {rule_text}{dtype}: {shown}")
    return lines


def is_expert_tensor(name: str, kind: Kind) -> bool:
    """A tensor whose first dimension is the number of experts (fused experts, router weights, router biases)."""
    return kind is not Kind.WEIGHT or bool(_EXPERTS.search(name))


_EXPERTS = re.compile(r"(^|\.)(experts|router|gate)(\.|$)")
