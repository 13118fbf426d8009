"""The demo model: the standard HF ``LlamaForCausalLM``, built from a config (nothing is downloaded).

Using the stock architecture means every snapshot pmakit writes loads with ``AutoModelForCausalLM.from_pretrained``,
exactly like a real pre-training checkpoint would.

With ``experts`` > 0 the model is transformers' own OLMoE (``OlmoeForCausalLM``: every MLP a mixture of experts
with a top-k softmax router and no shared expert; of the HF MoEs it is the plainest, and Qwen2-MoE's shared expert
only adds time on a CPU). Its router is swapped for ``BiasedRouter`` (``pmakit.train.router``, loaded with the
first MoE model, so that checking a config loads none of transformers' modelling code: ~2.3 s after torch), a
subclass that adds a per-expert
load-balancing bias to the routing scores for the top-k choice only (DeepSeek-V3's auxiliary-loss-free balancing).
The bias is a persistent buffer named as in HF's DeepSeek-V3, ``mlp.gate.e_score_correction_bias``, so every
snapshot carries it and a merge has to decide what to do with it (average it or take the newest). The trainer
moves it after each step (``balance_experts``); the weights of the chosen experts stay the unbiased softmax
probabilities, so the bias steers the choice and never the output's scale. A snapshot loads with
``OlmoeForCausalLM.from_pretrained`` (the bias is then an unexpected key, dropped: plain top-k routing); to route
as trained, build the model with ``build_model`` and load the state into it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import torch

from pmakit.config import AT_LEAST_1, NON_NEGATIVE, check_fields
from pmakit.errors import PmakitError

if TYPE_CHECKING:
    from pmakit.train.router import BiasedRouter


@dataclass(frozen=True)
class ModelConfig:
    """Size of a Llama-style decoder."""

    layers: Annotated[int, AT_LEAST_1] = 4
    """Transformer blocks."""
    hidden: Annotated[int, AT_LEAST_1] = 192
    """Model width."""
    heads: Annotated[int, AT_LEAST_1] = 6
    """Attention heads (head size = hidden / heads)."""
    kv_heads: Annotated[int | None, AT_LEAST_1] = None
    """Key/value heads for grouped-query attention (default: heads)."""
    intermediate: Annotated[int | None, AT_LEAST_1] = None
    """MLP width (default: about 8/3 x hidden, rounded to a multiple of 32)."""
    seq_len: Annotated[int, AT_LEAST_1] = 256
    """Context length in tokens."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head (saves parameters at small sizes)."""
    experts: Annotated[int, NON_NEGATIVE] = 0
    """Experts per MLP: 0 is the dense Llama; more is an OLMoE mixture of experts with a biased top-k router."""
    top_k: Annotated[int, AT_LEAST_1] = 2
    """Experts each token is routed to (MoE only)."""
    expert_width: Annotated[int | None, AT_LEAST_1] = None
    """Each expert's MLP width (MoE only; default: hidden, so top-2 is about the dense MLP's active width)."""

    def __post_init__(self) -> None:
        check_fields(self, "model")  # the bounds declared on the fields above
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise PmakitError(
                f"model.kv_heads ({self.kv_heads}) must be a positive divisor of model.heads ({self.heads})"
            )
        if self.hidden % self.heads:
            raise PmakitError(
                f"model.hidden ({self.hidden}) must be a multiple of model.heads ({self.heads})"
            )
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise PmakitError(
                f"model.experts must be 0 (dense) or positive with 1 <= model.top_k <= model.experts, got "
                f"experts={self.experts}, top_k={self.top_k}"
            )

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 32 * round(8 * self.hidden / 3 / 32)


def _decoder_fields(cfg: ModelConfig, vocab_size: int, bos: int | None, eos: int | None) -> dict[str, Any]:
    """What the Llama and the OLMoE configs share: the trunk's sizes, the norm and the special tokens."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads or cfg.heads,
        "max_position_embeddings": cfg.seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rms_norm_eps": 1e-5,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "use_cache": False,
    }


def llama_config(cfg: ModelConfig, vocab_size: int, *, bos: int | None = None, eos: int | None = None) -> Any:
    """A ``transformers.LlamaConfig`` for this size."""
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=cfg.mlp_width, **_decoder_fields(cfg, vocab_size, bos, eos))


def olmoe_config(cfg: ModelConfig, vocab_size: int, *, bos: int | None = None, eos: int | None = None) -> Any:
    """A ``transformers.OlmoeConfig`` for this size (``cfg.experts`` > 0)."""
    from transformers import OlmoeConfig

    return OlmoeConfig(
        intermediate_size=cfg.expert_width or cfg.hidden,
        num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=True,
        **_decoder_fields(cfg, vocab_size, bos, eos),
    )


def build_model(
    cfg: ModelConfig, vocab_size: int, *, seed: int = 0, **token_ids: int | None
) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (``OlmoeForCausalLM`` with biased routers when ``cfg.experts``),
    deterministic in ``seed``, fp32 on the CPU."""
    from transformers import LlamaForCausalLM, OlmoeForCausalLM

    if cfg.moe:
        from pmakit.train.router import BiasedRouter
    config = (olmoe_config if cfg.moe else llama_config)(cfg, vocab_size, **token_ids)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (OlmoeForCausalLM if cfg.moe else LlamaForCausalLM)(config)
        if cfg.moe:
            for layer in model.model.layers:
                layer.mlp.gate = BiasedRouter.replacing(layer.mlp.gate)
    return model


def routers(model: torch.nn.Module) -> list[BiasedRouter]:
    """The model's biased routers, first layer first (empty for a dense model)."""
    router = sys.modules.get("pmakit.train.router")  # none built before the module that defines them loads
    return [m for m in model.modules() if isinstance(m, router.BiasedRouter)] if router else []


def balance_experts(model: torch.nn.Module, rate: float) -> None:
    """One step of auxiliary-loss-free balancing: ``bias += rate * sign(mean load - load)`` per router over the
    tokens counted since the last call (DeepSeek-V3, section 2.1.2), then the counts restart. ``rate`` 0 only
    clears the counts."""
    with torch.no_grad():
        for r in routers(model):
            if rate:
                r.e_score_correction_bias += rate * torch.sign(r.load.mean() - r.load)
            r.load.zero_()


def active_parameters(model: torch.nn.Module) -> int:
    """Parameters one token passes through: all of a dense model; a MoE's top-k of its experts (and every router)."""
    total = count_parameters(model)
    for r in routers(model):
        experts_module = model.get_submodule(f"{_parent(model, r)}.experts")
        experts = sum(p.numel() for p in experts_module.parameters())
        total -= experts - experts * r.top_k // r.num_experts
    return total


def _parent(model: torch.nn.Module, module: torch.nn.Module) -> str:
    name = next(n for n, m in model.named_modules() if m is module)
    return name.rpartition(".")[0]


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
