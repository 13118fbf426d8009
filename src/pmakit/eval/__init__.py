"""Downstream evaluation of merges through lm-evaluation-harness (``pmakit eval``).

The parts (the recipe grammar they read, "which snapshots, which weights", is ``pmakit.merge.recipe``, shared with
``pmakit merge --recipe``): ``model`` (a recipe's model, merged in memory
or through a removed temporary folder), ``harness`` (the lm-eval bridge: ``HFLM`` on the in-memory module, per-item
scores), ``backend`` (pmakit as lm-eval's ``model="pmakit"``), ``tasks`` (offline lm-eval YAML tasks built from a
corpus's held-out files), ``stats`` (item-level standard errors, paired differences, bootstrap, the noise band) and
``run`` (``evaluate``: targets x recipes x tasks -> rows in ``evals.jsonl``, resumable). It calls the engine and the
trainer's data code, never ``lab/`` or ``report/``.

Importing this package registers ``pmakit`` as an lm-eval model backend (lazily; nothing when lm-eval is absent).
"""

from __future__ import annotations


def _register_backend() -> None:
    try:
        import lm_eval.models  # noqa: F401  (lm-eval's own names first: its registry fills itself only when empty)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return
    if "pmakit" not in model_registry:
        model_registry.register("pmakit", target="pmakit.eval.backend:PmakitLM")


_register_backend()
