"""Report section of the ``moe`` study: routing health of latest / merge / anneal, the bias rule, the compute.

Reads RUN/moe.json (written by ``pmakit.lab.moe``); every number names its split and batch count.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pmakit.report import fmt
from pmakit.report.blocks import Block, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import read_json_object

FIGURE = "plots/moe_routing.png"
SHOWN = ("latest", "merged, bias average", "annealed")


def read_moe(run_dir: Path) -> dict[str, Any] | None:
    """RUN/moe.json, or None when absent or unreadable."""
    data = read_json_object(run_dir / "moe.json")
    return data if data is not None and isinstance(data.get("routing"), list) else None


def draw(run_dir: Path, data: dict[str, Any]) -> Path | None:
    """plots/moe_routing.png: per layer, each expert's share of the test split's slots for latest / merge / anneal,
    and each model's router entropy per layer."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pmakit.report.plots import ANNEAL, LATEST, MERGE, _save

    rows = [r for r in data["routing"] if r["split"] == "test"]
    layers = sorted({r["layer"] for r in rows})
    if not layers:
        return None
    colors = dict(zip(SHOWN, (LATEST, MERGE, ANNEAL)))
    fig = Figure(figsize=(3.0 * (len(layers) + 1), 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(layers) + 1, squeeze=False)[0]
    batches = data["batches"]["test"]
    for ax, layer in zip(axes, layers):
        for i, name in enumerate(SHOWN):
            r = next((r for r in rows if r["model"] == name and r["layer"] == layer), None)
            if r is None:
                continue
            x = np.arange(len(r["load"]))
            ax.bar(x + (i - 1) * 0.27, r["load"], width=0.27, color=colors[name], label=name)
            ax.axhline(r["mean_load"], color="#888888", lw=0.8, ls="--")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("share of top-k slots")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for name in SHOWN:
        pts = sorted((r["layer"], r["entropy"]) for r in rows if r["model"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[name], label=name)
    if rows:
        ax.axhline(rows[0]["entropy_max"], color="#888888", lw=0.8, ls="--", label="log E")
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("router entropy (nats)")
    ax.set_title("entropy", fontsize=9)
    fig.suptitle(f"Routing on the test split ({batches} batches); dashed: uniform share / log E", fontsize=10)
    return _save(fig, run_dir / FIGURE)


def _test_rows(data: dict[str, Any]) -> list[list[str]]:
    """Per model on the test split: loss, its paired difference to the latest snapshot, and routing health over
    the layers (the worst max/mean load, dead experts summed, mean entropy)."""
    rows = []
    for r in data["losses"]:
        if r["split"] != "test":
            continue
        health = [h for h in data["routing"] if h["model"] == r["model"] and h["split"] == "test"]
        rows.append(
            [
                r["model"],
                f"{fmt.loss(r['val_loss'])} ± {fmt.loss(r['val_loss_se'])}",
                "–"
                if r["model"] == "latest"
                else f"{fmt.signed(r['delta_vs_latest'])} ± {fmt.loss(r['delta_se'])}",
                f"{max(h['max_over_mean'] for h in health):.2f}" if health else "–",
                str(sum(h["dead_experts"] for h in health)) if health else "–",
                f"{sum(h['entropy'] for h in health) / len(health):.3f}" if health else "–",
            ]
        )
    return rows


def blocks(run_dir: Path) -> list[Block]:
    """The section: loss and routing health per model, the bias rule, the compute a merge saves."""
    data = read_moe(run_dir)
    if data is None:
        return []
    batches = data["batches"]
    out: list[Block] = [
        Heading("Mixture of experts: routing health and the router-bias rule"),
        Paragraph(
            f"{data['experts']} experts per layer, top-{data['top_k']}; balancing: aux loss x "
            f"{data['router_aux_coef']:g}, aux-free bias step {data['router_bias_rate']:g}. At "
            f"{fmt.tokens(data['tokens'])} tokens (the last fork's end): the latest snapshot, the anneal, and the "
            f"merge {data['merge']['label']} (chosen on the selection split) with the routers' bias averaged or "
            f"taken from its newest snapshot. Test split: {batches['test']} batches of "
            f"{data['tokens_per_batch']} tokens; selection split: {batches['selection']} batches. Load: each "
            f"expert's share of the top-k slots (sums to 1 per layer); dead: a share below "
            f"{data['dead_share']:g} / E; dropped tokens: none (no capacity factor: every token reaches its k "
            "experts); entropy: mean over tokens of the router's softmax entropy (at most log E = "
            f"{math.log(data['experts']):.3f})."
        ),
    ]
    out.append(
        Table(
            ["model (test split)", "loss ± s.e.", "Δ vs latest ± s.e.", "max/mean load", "dead", "entropy"],
            _test_rows(data),
        )
    )
    rule = data["bias_rule"]
    z = rule["latest_minus_average_test"] / rule["se"] if rule["se"] else float("nan")
    out.append(
        Paragraph(
            f"Router bias in the merge: newest − averaged = {fmt.signed(rule['latest_minus_average_test'])} ± "
            f"{fmt.loss(rule['se'])} nats on the test split ({rule['batches']} batches, paired; {z:+.1f} s.e.). "
            f"The selection split picks **{rule['chosen_on_selection']}**"
            + (
                "; the difference is within two paired standard errors on the test split, so neither rule is "
                "shown better here."
                if not abs(z) >= 2
                else "."
            )
        )
    )
    c = data["compute"]
    out.append(
        Paragraph(
            f"Compute: the anneal trains {fmt.tokens(c['anneal_tokens'])} tokens, 6 x "
            f"{c['active_parameters'] / 1e6:.2f}M active parameters x D = {c['anneal_flops']:.3g} FLOPs "
            f"(of {c['parameters'] / 1e6:.2f}M parameters, top-{data['top_k']} of {data['experts']} experts). "
            f"The merge reads {c['merge_snapshots_read']} snapshots ({c['merge_bytes_read'] / 1e6:.1f} MB in fp32) "
            f"and is scored once on {fmt.tokens(c['merge_eval_tokens'])} tokens: 2 x active x tokens = "
            f"{c['merge_flops']:.3g} FLOPs, {c['anneal_flops'] / c['merge_flops']:.0f}x less."
        )
    )
    try:
        figure = draw(run_dir, data)
    except Exception as e:  # a plot must not take the tables down with it
        out.append(
            Paragraph(f"The routing plot could not be drawn ({e.__class__.__name__}: {e}).", note=True)
        )
        figure = None
    if figure is not None:
        out.append(
            FigureBlock(
                figure.relative_to(run_dir),
                "Per-expert load and router entropy: latest vs merge vs anneal",
                [f"Test split, {batches['test']} batches of {data['tokens_per_batch']} tokens."],
            )
        )
    return out
