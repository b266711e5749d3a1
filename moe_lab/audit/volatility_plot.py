"""The figure of `moe-lab volatility`: per MoE layer, the share of activated experts that changed (the paper's
routing-volatility figure) and of positions with any change, and the router shift beside it."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend


def plot(per_layer: list[dict], summary: dict, path: Path) -> None:
    layers = [row["layer"] for row in per_layer]
    x = list(range(len(layers)))
    fig = Figure(figsize=(max(6.0, 0.35 * len(layers) + 3.0), 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    width = 0.4
    top.bar([i - width / 2 for i in x], [row["expert_change"] for row in per_layer], width, label="expert_change")
    top.bar([i + width / 2 for i in x], [row["any_change"] for row in per_layer], width, label="any_change")
    top.axhline(summary["expert_change"], color="black", lw=1, ls="--",
                label=f"expert_change, all layers: {summary['expert_change']:.4f}")
    top.set_ylabel("share changed")
    top.set_ylim(0, 1.3)  # room above the bars for the legend
    top.legend(fontsize=8, ncols=3, loc="upper center")
    top.set_title(f"{summary['family']}: routing volatility over {summary['response_tokens']} response tokens\n"
                  f"log-ratio variance {summary['logratio_var']:.3g}, routing share of it "
                  f"{summary['routing_share']:.2f}", fontsize=9)
    bottom.bar(x, [row["router_shift"] for row in per_layer], 0.6, color="tab:green")
    bottom.set_ylabel("router shift")
    bottom.set_xlabel("decoder layer (MoE layers)")
    bottom.set_xticks(x, [str(layer) for layer in layers])
    fig.savefig(path, dpi=120)
