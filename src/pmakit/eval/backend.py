"""pmakit as an lm-eval model backend: ``simple_evaluate(model="pmakit", model_args="run=RUN,merge=sma:10")``.

``import pmakit.eval`` registers the name ``pmakit`` in lm-eval's model registry (lazily: this module, and lm-eval's
``HFLM`` with it, is imported only when lm-eval builds the model). lm-eval 0.4.13 does not discover backends by
entry point, so the import is what makes the name known there; pyproject declares the ``lm_eval.models`` entry
point for releases that do.

model_args:
    run      a run directory (or a snapshot, or several joined by ``+``): the recipe picks among its snapshots
    merge    a recipe (``pmakit.merge.recipe``; default ``latest``)
    path     instead of run/merge: a model folder evaluated as it is
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.api.registry import register_model

from pmakit.eval.lm import WindowedHFLM
from pmakit.eval.model import build, build_path
from pmakit.merge.recipe import parse_recipe, resolve


@register_model("pmakit")
class PmakitLM(WindowedHFLM):
    """lm-eval's ``HFLM`` (``WindowedHFLM``) on a pmakit merge built in memory (``pmakit.eval.model.build``)."""

    def __init__(
        self, run: str | None = None, merge: str = "latest", path: str | None = None, **kwargs: Any
    ) -> None:
        from pmakit.errors import PmakitError
        from pmakit.snapshot import gather

        if (run is None) == (path is None):
            raise PmakitError("the pmakit backend takes model_args run=RUN[,merge=RECIPE] or path=MODEL_DIR")
        if path is not None:
            built = build_path(Path(path))
        else:
            snapshots, _ = gather([Path(p) for p in str(run).split("+")])
            built = build(resolve(parse_recipe(str(merge)), snapshots))
        self.pmakit_how = built.how
        kwargs.pop("pretrained", None)
        kwargs.setdefault("device", "cpu")
        super().__init__(pretrained=built.model, tokenizer=built.tokenizer, **kwargs)
