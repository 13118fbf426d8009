"""The columns of each study's result tables (RUN/results.csv and its siblings): one declaration that the studies
write (``pmakit.lab``) and the report reads. A leaf: it imports nothing."""

from __future__ import annotations

PMA_COLUMNS = (
    "fork_tokens", "model", "method", "n", "v_tokens", "alpha", "tokens", "window_start_tokens",
    "val_loss", "val_loss_se", "bpb", "delta_vs_latest", "delta_se", "label", "split", "role",
)  # fmt: skip
"""The PMA study's results.csv (``pmakit.report.load.Row`` says what each column holds); the moe study's too."""

SCALING_COLUMNS = (
    "size", "params", "params_total", "tokens", "kind", "recipe", "val_loss", "val_loss_se", "bpb",
    "window_start_tokens", "merged", "label",
)  # fmt: skip
"""The scaling study's results.csv: one test-split row per (size, budget D, kind: merge | anneal | latest)."""

SWEEP_COLUMNS = (
    "candidate", "lr", "weight_decay", "batch_size", "tokens", "kind", "recipe", "val_loss", "val_loss_se", "bpb",
    "window_start_tokens", "merged",
)  # fmt: skip
"""The sweep study's results.csv: one test-split row per (candidate, point, kind: latest | fixed | tuned | anneal)."""

RECOVERY_COLUMNS = (
    "study", "seed", "stage", "model", "method", "n", "optimizer", "resume_lr", "start_tokens", "tokens",
    "window_start_tokens", "val_loss", "val_loss_se", "bpb", "delta_vs_latest", "delta_se", "delta_vs_control",
    "delta_control_se", "grad_norm_mean", "grad_norm_max", "grad_norm_tv", "label",
)  # fmt: skip
"""The spike and init studies' results.csv. study: spike|init; seed: the training seed; stage: ``start`` (the
weights an arm starts from, before any training), ``early`` (init study: after ``early_tokens``), ``final`` (at the
end); model: the arm (``no-intervention``, ``latest/reset``, ``sma3/keep``, ... ; init: ``latest``, ``sma8``);
method/n: the merge (``latest`` for one snapshot); optimizer: reset|keep (empty for the no-intervention run and start
rows); resume_lr: the LR policy of the arm in words; start_tokens: where the arm starts; tokens: the training tokens
of the scored weights; window_start_tokens: the oldest merged snapshot; val_loss/val_loss_se/bpb: mean nats per
token on the fixed held-out batches and its s.e. over batches; delta_vs_latest/delta_se: this arm minus the
latest-snapshot arm with the same optimizer, seed, stage (paired s.e. over batches; 0 for the latest arms);
delta_vs_control/delta_control_se: this arm minus the no-intervention run at the same tokens (spike study);
grad_norm_mean/max/tv: the arm's gradient norm over its first ``early_tokens`` (tv = mean absolute step-to-step
change, a roughness measure); label: short human text."""
RECOVERY_CURVE_COLUMNS = ("series", "tokens", "val_loss", "val_loss_se", "arm", "seed")
"""The spike and init studies' curves.csv."""
RECOVERY_TRAIN_CURVE_COLUMNS = ("arm", "seed", "step", "tokens", "loss", "grad_norm", "lr")
"""The spike and init studies' train_curves.csv."""

REPLICAS_COLUMNS = (
    "arm", "model", "tokens", "all_reduces", "val_loss", "val_loss_se", "bpb",
    "delta_vs_sync", "delta_vs_sync_se", "delta_vs_single", "delta_vs_single_se",
)  # fmt: skip
"""The replicas study's results.csv."""
REPLICAS_CURVE_COLUMNS = ("arm", "model", "tokens", "all_reduces", "val_loss", "val_loss_se")
"""The replicas study's curves.csv."""
