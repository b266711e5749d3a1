"""Draw the routing columns of a Hugging Face trainer's log (``trainer_state.json``, or ``log_history``).

Three panels over optimizer steps: per-layer expert change (``routing/layer_<i>/expert_change``, i the decoder
layer; with ``routing/expert_change_latent`` dashed, the router's own choice, which is what moves under replay),
per-layer router shift (``routing/layer_<i>/router_shift``) and the generation/training mismatch
(``mismatch/k3``). Not TRL-specific: any trainer whose log rows carry these columns (MoEGRPOTrainer's do).

    python -m moe_lab.integrations.trainer_state_plot out/checkpoint-8/trainer_state.json [-o routing.png]

or, during training, ``RoutingPlotCallback()`` in the trainer's ``callbacks`` writes ``<output_dir>/routing.png``
when training ends. Uses matplotlib's object API (no pyplot, no global backend change).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from transformers import TrainerCallback

PANELS = (("expert_change", "expert change (share of top-k slots)"), ("router_shift", "router shift"))
_LAYER = re.compile(r"^routing/layer_(\d+)/(\w+)$")


def read_log(path: str | Path) -> list[dict]:
    """``log_history`` of a trainer_state.json (a file, or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "trainer_state.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: no trainer_state.json there (a checkpoint folder or the file itself)")
    return json.loads(path.read_text(encoding="utf-8")).get("log_history", [])


def series(log: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{column: (steps, values)} of the routing/* and mismatch/* columns, rows without them skipped."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in log:
        for key, value in row.items():
            if key.split("/")[0] in ("routing", "mismatch") and isinstance(value, (int, float)):
                steps, values = out.setdefault(key, ([], []))
                steps.append(int(row.get("step", len(steps))))
                values.append(float(value))
    return out


def draw(log: list[dict], out: str | Path) -> Path:
    """The three panels as one image at ``out``; ValueError when the log has no routing columns."""
    from matplotlib.figure import Figure

    cols = series(log)
    if not any(_LAYER.match(k) for k in cols) and "mismatch/k3" not in cols:
        raise ValueError("the log has no routing/layer_<i>/* or mismatch/k3 columns (moe_metrics off?)")
    fig = Figure(figsize=(13, 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (metric, title) in zip(axes, PANELS):
        for key in sorted((k for k in cols if (m := _LAYER.match(k)) and m.group(2) == metric),
                          key=lambda k: int(_LAYER.match(k).group(1))):
            ax.plot(*cols[key], marker=".", label=f"layer {_LAYER.match(key).group(1)}")
        if metric == "expert_change" and "routing/expert_change_latent" in cols:
            # under replay the per-layer change is 0 by construction; the router's own choice is the latent one
            ax.plot(*cols["routing/expert_change_latent"], ls="--", color="k", label="latent, all layers")
        ax.set(title=title, xlabel="optimizer step")
        if ax.lines:
            ax.legend(fontsize="small")
    if "mismatch/k3" in cols:
        axes[2].plot(*cols["mismatch/k3"], marker=".", color="k")
    axes[2].set(title="mismatch k3 (generation vs training)", xlabel="optimizer step")
    out = Path(out)
    fig.savefig(out, dpi=120)
    return out


class RoutingPlotCallback(TrainerCallback):
    """Writes ``<output_dir>/routing.png`` (the three panels) when training ends, on the main process."""

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            draw(state.log_history, Path(args.output_dir) / "routing.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trainer_state", help="trainer_state.json, or the checkpoint folder holding it")
    ap.add_argument("-o", "--out", default=None, help="image file (default: routing.png beside the json)")
    opts = ap.parse_args(argv)
    src = Path(opts.trainer_state)
    out = opts.out or (src if src.is_dir() else src.parent) / "routing.png"
    print(draw(read_log(src), out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
