"""HF Trainer checkpoints: ``checkpoint-N/`` with the model's weights and ``trainer_state.json``.

Tokens come from ``num_input_tokens_seen`` (``include_num_input_tokens_seen=True``), else ``global_step`` x
``tokens_per_step``. ``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth`` are not weights (see
``formats.torch_io``).
"""

from __future__ import annotations

from pathlib import Path

from pmakit.layouts.base import IncompleteSnapshot, Layout, Snapshot, float_or_none, load_json
from pmakit.layouts.pmakit import require_weights

STATE_FILE = "trainer_state.json"


class HFTrainerLayout(Layout):
    name = "hf-trainer"

    def is_snapshot(self, path: Path) -> bool:
        return (path / STATE_FILE).is_file()

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        require_weights(path)
        state_file = path / STATE_FILE
        state = load_json(state_file)
        step = state.get("global_step")
        if not isinstance(step, int):
            raise IncompleteSnapshot(state_file, "no integer global_step")
        seen = state.get("num_input_tokens_seen") or 0
        history = [h for h in state.get("log_history", []) if isinstance(h, dict)]
        lr = next((h["learning_rate"] for h in reversed(history) if "learning_rate" in h), None)
        loss = next((h["loss"] for h in reversed(history) if "loss" in h), None)
        if seen > 0:
            tokens, source = int(seen), self.name
        elif tokens_per_step:
            tokens, source = step * tokens_per_step, "name"
        else:
            raise IncompleteSnapshot(
                state_file,
                "no token count (num_input_tokens_seen is 0): pass --tokens-per-step N (the "
                "tokens of one optimizer step: sequence length x batch size x gradient accumulation x "
                "processes), or train with include_num_input_tokens_seen=True in TrainingArguments",
            )
        return Snapshot(
            path,
            tokens=tokens,
            step=step,
            lr=float_or_none(lr),
            loss=float_or_none(loss),
            source=source,
            meta=state,
            layout=self.name,
        )


LAYOUT = HFTrainerLayout()
