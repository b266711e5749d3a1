"""docs/extending.md's "A new step component", done: its steps applied, exactly as the page gives them, to a copy
of the package and of docs/metrics.md; a one-step run of the copy must log routing/router_drift equal to the
routers' relative weight change between the cold start and the run's checkpoint, and a run without the field must
log no such column."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

from recipes import PKG, block, copy_package, insert, run_python

from moe_lab.config import apply_overrides
from moe_lab.config.yaml_io import load_yaml

ROOT = PKG.parent
METRIC = "routing/router_drift"

CHECK = textwrap.dedent("""
    import json, math, re, sys
    from pathlib import Path
    import safetensors.torch, torch
    import moe_lab
    assert moe_lab.__file__.startswith(sys.argv[1]), moe_lab.__file__  # the copy, not the checkout
    from moe_lab.analysis.tables import load_runs
    from moe_lab.config import from_dict, validate
    from moe_lab.models import load_model
    from moe_lab.rl.coldstart import cold_start
    from moe_lab.rl.dp_split import reduction_of, reductions
    from moe_lab.rl.loop import train
    from moe_lab.rl.optim import router_parameters

    metric, root, data = "%s", Path(sys.argv[2]), json.loads(sys.argv[3])
    off = validate(from_dict(data))
    data["rl"]["router_drift"] = True
    on = validate(from_dict(data))
    assert on.rl.section("cadence").router_drift and not off.rl.router_drift
    assert train(on, root / "on" / "runs" / "r", run_id="r", arm="grpo") == "done"
    assert train(off, root / "off" / "runs" / "r", run_id="r", arm="grpo") == "done"
    metrics, _ = load_runs(root / "on")
    assert metric in metrics and metrics[metric].notna().all(), "not in every logged row"
    assert metric not in load_runs(root / "off")[0]

    # the logged value against the weights: the cold start's routers and the checkpoint's after the one step
    start = load_model(cold_start(on))
    ids = {id(p) for p in router_parameters(start)}
    names = [n for n, p in start.named_parameters() if id(p) in ids]
    end = safetensors.torch.load_file(str(root / "on" / "runs" / "r" / "checkpoint" / "model.safetensors"))
    params = dict(start.named_parameters())
    moved = math.sqrt(sum(float(((end[n] - params[n].detach()) ** 2).sum()) for n in names))
    drift = moved / math.sqrt(sum(float((params[n].detach() ** 2).sum()) for n in names))
    assert drift > 0 and all(abs(v - drift) <= 1e-5 * drift for v in metrics[metric]), (drift, list(metrics[metric]))

    assert reduction_of(metric, reductions()) == "same"
    doc = (Path(sys.argv[1]).parent / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert f"| `{metric}` |" in doc
    print("component ok")
""")


def _apply_recipe(tmp_path: Path) -> Path:
    pkg = copy_package(tmp_path)
    insert(pkg / "config" / "rl.py", "    eval_every: int = param(10,", block("component-field"), before=True)
    insert(pkg / "rl" / "components.py", "@dataclass\nclass Components:", block("component-class"), before=True)
    insert(pkg / "rl" / "components.py", "from moe_lab.rl.expert_bias import ExpertBias\n", block("component-import"),
           before=False)
    insert(pkg / "rl" / "components.py", "        return cls(tuple(parts))", block("component-build"), before=True)
    insert(pkg / "routing" / "metrics.py", '"routing/expert_change": R.TOKEN_MEAN,',
           block("component-reduction").rstrip("\n"), before=False)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "metrics.md", tmp_path / "docs" / "metrics.md")
    source = (tmp_path / "docs" / "metrics.md").read_text(encoding="utf-8")
    row = source[source.index("| `routing/bias_change_share` |"):]
    insert(tmp_path / "docs" / "metrics.md", row[:row.index("\n") + 1], block("component-row"), before=False)
    return pkg


def test_the_new_component_recipe(tmp_path):
    assert METRIC not in (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")  # the example is new
    pkg = _apply_recipe(tmp_path)
    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))["base"]
    config = apply_overrides(smoke, [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=1", "rl.algo=grpo",
                                     "rl.router_lr_mult=10"])
    done = run_python(tmp_path, ["-c", CHECK % METRIC, str(pkg), str(tmp_path / "results"), json.dumps(config)])
    assert done.returncode == 0 and "component ok" in done.stdout, done.stderr[-3000:]
