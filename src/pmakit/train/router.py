"""The biased top-k router of the MoE demo model (``pmakit.train.model``): transformers' OLMoE router with a
load-balancing bias on the choice of the experts. Its own module, imported when a MoE model is built: subclassing
OLMoE's router loads transformers' modelling code (~2.3 s after torch, shared by every model), which a command that
builds no model (``pmakit experiment`` refusing a config) does not need."""

from __future__ import annotations

from typing import Any

import torch


def _router_base() -> type[torch.nn.Module]:
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter

    return OlmoeTopKRouter


class BiasedRouter(_router_base()):  # type: ignore[misc]
    """OLMoE's top-k router with a load-balancing bias on the choice (not the weights) of the experts.

    ``e_score_correction_bias`` (persistent, fp32) is added to the softmax probabilities before the top-k; the
    chosen experts' weights are their unbiased probabilities, renormalised as OLMoE does. In training mode the router
    counts the tokens each expert was given (``load``, not persistent) for ``balance_experts``.
    ``observe``: when set, every forward appends (unbiased probabilities, chosen experts) to it, for the routing
    health of a held-out set (``routing_stats``).
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))
        self.register_buffer("load", torch.zeros(self.num_experts), persistent=False)
        self.observe: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def replacing(cls, router: torch.nn.Module) -> BiasedRouter:
        """A biased router with ``router``'s config and weight (zero bias)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.top_k, new.num_experts = router.top_k, router.num_experts
        new.norm_topk_prob, new.hidden_dim = router.norm_topk_prob, router.hidden_dim
        new.weight = router.weight
        new.register_buffer("e_score_correction_bias", torch.zeros(new.num_experts))
        new.register_buffer("load", torch.zeros(new.num_experts), persistent=False)
        new.observe = None
        return new

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        chosen = torch.topk(probs.detach() + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.training:
            self.load += torch.bincount(chosen.reshape(-1), minlength=self.num_experts).to(self.load)
        if self.observe is not None:
            self.observe.append((probs.detach(), chosen))
        return logits, weights.to(logits.dtype), chosen
