"""The demo model: the standard HF ``LlamaForCausalLM``, built from a config (nothing is downloaded).

Using the stock architecture means every snapshot pmakit writes loads with ``AutoModelForCausalLM.from_pretrained``,
exactly like a real pre-training checkpoint would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from pmakit.errors import PmakitError


@dataclass(frozen=True)
class ModelConfig:
    """Size of a Llama-style decoder."""

    layers: int = 4
    """Transformer blocks."""
    hidden: int = 192
    """Model width."""
    heads: int = 6
    """Attention heads (head size = hidden / heads)."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention (default: heads)."""
    intermediate: int | None = None
    """MLP width (default: about 8/3 x hidden, rounded to a multiple of 32)."""
    seq_len: int = 256
    """Context length in tokens."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head (saves parameters at small sizes)."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise PmakitError(
                f"model.hidden ({self.hidden}) must be a multiple of model.heads ({self.heads})"
            )
        if min(self.layers, self.hidden, self.heads, self.seq_len) < 1:
            raise PmakitError(f"model sizes must be positive: {asdict(self)}")

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 32 * round(8 * self.hidden / 3 / 32)


def llama_config(cfg: ModelConfig, vocab_size: int, *, bos: int | None = None, eos: int | None = None) -> Any:
    """A ``transformers.LlamaConfig`` for this size."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.mlp_width,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads or cfg.heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        use_cache=False,
    )


def build_model(
    cfg: ModelConfig, vocab_size: int, *, seed: int = 0, **token_ids: int | None
) -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (deterministic in ``seed``), fp32 on the CPU."""
    from transformers import LlamaForCausalLM

    config = llama_config(cfg, vocab_size, **token_ids)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
