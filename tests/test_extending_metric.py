"""docs/extending.md's "A new metric", done: its four steps applied, exactly as the page gives them, to a copy
of the package and of docs/metrics.md; a two-step run of the copy must log the metric in every row, with the
reduction and the row the recipe declares, and the summary over seeds must carry it."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

from recipes import PKG, block, copy_package, insert, run_python

from moe_lab.config import apply_overrides
from moe_lab.config.yaml_io import load_yaml

ROOT = PKG.parent
METRIC = "response/length_min"

CHECK = textwrap.dedent("""
    import json, math, re, sys
    from pathlib import Path
    import moe_lab
    assert moe_lab.__file__.startswith(sys.argv[1]), moe_lab.__file__  # the copy, not the checkout
    from moe_lab.analysis.results import summarize
    from moe_lab.analysis.tables import load_runs
    from moe_lab.config import from_dict, validate
    from moe_lab.rl.dp_split import combine_metrics, reduction_of, reductions
    from moe_lab.rl.loop import train

    metric, run_dir = "%s", Path(sys.argv[2]) / "runs" / "grpo-s0"
    assert train(validate(from_dict(json.loads(sys.argv[3]))), run_dir, run_id="grpo-s0", arm="grpo") == "done"
    metrics, _ = load_runs(run_dir.parent.parent)
    assert metric in metrics and metrics[metric].notna().all(), "not in every logged row"
    # the shortest response is no longer than the mean or the longest, and every response has >= 1 token (EOS)
    assert (1 <= metrics[metric]).all() and (metrics[metric] <= metrics["response/length_mean"]).all()
    assert (metrics["response/length_mean"] <= metrics["response/length_max"]).all()
    assert metrics.groupby("step")[metric].nunique().eq(1).all()  # one value per step's rollout batch

    table = reductions()
    assert reduction_of(metric, table) == "min"
    assert combine_metrics([({metric: 5.0}, 4.0, 20.0), ({metric: 3.0}, 4.0, 9.0)]) == {metric: 3.0}
    doc = (Path(sys.argv[1]).parent / "docs" / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\\| `([a-z_]+/[a-z_{}0-9/]+)`", doc, re.M))
    assert metric in documented
    for name in documented - {m for m in documented if m.startswith("eval/")}:
        reduction_of(name.replace("{i}", "0"), table)  # every row still declares its reduction

    summary = summarize(metrics, load_runs(run_dir.parent.parent)[1]).iloc[0]
    last = metrics.loc[metrics["step"] == metrics["step"].max(), metric].mean()  # 2 steps: the last quarter is 1
    assert summary[metric] == last and math.isnan(summary[metric + "_lo"]), (summary[metric], last)
    print("metric ok")
""")


def _apply_recipe(tmp_path: Path) -> Path:
    pkg = copy_package(tmp_path)
    insert(pkg / "rl" / "collect.py", '            "response/length_max": float(batch.response_len_B.max())}',
            block("metric-value"), before=True)
    insert(pkg / "rl" / "collect.py", '"response/length_max": R.MAX,\n', block("metric-reduction"), before=False)
    insert(pkg / "analysis" / "tables.py", '"reward/mean")', block("metric-summary").rstrip("\n") + " ",
            before=True)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "metrics.md", tmp_path / "docs" / "metrics.md")
    row = "| `response/length_mean`, `response/length_max` |"
    source = (tmp_path / "docs" / "metrics.md").read_text(encoding="utf-8")
    end = source.index("\n", source.index(row)) + 1  # below that row (the recipe's place; _insert checks it once)
    insert(tmp_path / "docs" / "metrics.md", source[source.index(row):end], block("metric-row"), before=False)
    return pkg


def test_the_new_metric_recipe(tmp_path):
    assert METRIC not in (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")  # the example is new
    pkg = _apply_recipe(tmp_path)
    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))["base"]
    config = apply_overrides(smoke, [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=2", "rl.algo=grpo"])
    done = run_python(tmp_path, ["-c", CHECK % METRIC, str(pkg), str(tmp_path / "results"), json.dumps(config)])
    assert done.returncode == 0 and "metric ok" in done.stdout, done.stderr[-3000:]
