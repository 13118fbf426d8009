"""lm-eval's ``HFLM`` for models whose context is shorter than a task's continuations.

lm-eval 0.4.13 scores a (context, continuation) pair in one forward pass of at most ``max_length`` tokens (the
model config's ``max_position_embeddings``: a pmakit run's ``seq_len``), cutting the context from the left, and
asserts that the continuation alone fits (``_loglikelihood_tokens``: ``len(continuation_enc) <= self.max_length``).
A model trained on a short context stops there with a bare ``AssertionError`` as soon as one candidate is longer:
the MoE smoke preset's 64-token OLMoE met 4 such candidate lines (65 to 77 tokens) among the 1,996 of the test items of
``pmakit_next_line``. The failure was the context length, not the experts.

``WindowedHFLM`` scores such a continuation the way lm-eval scores a long document (``loglikelihood_rolling``):
in pieces of at most ``max_length`` tokens, each conditioned on the tokens before it (context and the
continuation's earlier tokens, cut from the left), log-likelihoods summed, greedy only if every piece is. A
request that fits is scored by lm-eval exactly as before, so models whose context holds every continuation get
the same numbers to the last digit.

It also tokenizes each string once per tokenizer, not once per model: a study or a tuner scores many models (or
one model's merges) on the same requests, and lm-eval encodes every context and continuation again on each call
(12% of a small model's scoring time).
"""

from __future__ import annotations

import weakref
from typing import Any

from lm_eval.models.huggingface import HFLM

Request = tuple[Any, list[int], list[int]]


def windows(requests: list[Request], limit: int) -> tuple[list[Request], list[int]]:
    """Each request, or its continuation's pieces of at most ``limit`` tokens, and the request each came from."""
    pieces: list[Request] = []
    owner: list[int] = []
    for i, (key, context, continuation) in enumerate(requests):
        if len(continuation) <= limit:
            pieces.append((key, context, continuation))
            owner.append(i)
            continue
        for start in range(0, len(continuation), limit):
            # no cache key: a piece is not the request lm-eval's cache hook would store under it
            head = (context + continuation[:start])[-limit:]
            pieces.append((None, head, continuation[start : start + limit]))
            owner.append(i)
    return pieces, owner


_ENCODED: weakref.WeakKeyDictionary[Any, dict[Any, tuple[int, ...]]] = weakref.WeakKeyDictionary()
"""Each tokenizer's encodings, by string and options (``WindowedHFLM.tok_encode``)."""


class WindowedHFLM(HFLM):
    """``HFLM`` that scores a continuation longer than the model's context in windows and tokenizes each string
    once per tokenizer (module docstring)."""

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        key = (
            string,
            add_special_tokens,
            left_truncate_len,
            self.add_bos_token,
            tuple(sorted(kwargs.items())),
        )
        cache = _ENCODED.setdefault(self.tokenizer, {})
        if key not in cache:
            cache[key] = tuple(super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs))
        return list(cache[key])

    def _loglikelihood_tokens(
        self, requests: list[Request], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        limit = int(self.max_length)
        if all(len(continuation) <= limit for _, _, continuation in requests):
            return list(super()._loglikelihood_tokens(requests, disable_tqdm, override_bs))
        pieces, owner = windows(requests, limit)
        scored = super()._loglikelihood_tokens(pieces, disable_tqdm, override_bs)
        total = [0.0] * len(requests)
        greedy = [True] * len(requests)
        for i, (ll, is_greedy) in zip(owner, scored):
            total[i] += float(ll)
            greedy[i] = greedy[i] and bool(is_greedy)
        return list(zip(total, greedy))
