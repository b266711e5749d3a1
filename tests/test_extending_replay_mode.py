"""docs/extending.md's "A new replay mode", done: its row added, exactly as the page gives it, to a copy of the
package. The new mode must take effect: with bf16 rollouts (the rollout's routes differ from the trainer's own
choice), a run with it equals a run with R3 bit for bit, its first update's log-probs equal the old ones (ratio
1: the recorded routes are forced), it differs from free routing, and a data-parallel split refuses it in one line."""

from __future__ import annotations

import json
import textwrap

from recipes import PKG, block, copy_package, insert, run_python

from moe_lab.config import apply_overrides
from moe_lab.config.yaml_io import load_yaml

ROOT = PKG.parent
ANCHOR = '               color="#7F3F63"),\n'

CHECK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import pandas as pd
    import moe_lab
    assert moe_lab.__file__.startswith(sys.argv[1]), moe_lab.__file__  # the copy, not the checkout
    from moe_lab.config import ConfigError, from_dict, validate
    from moe_lab.config.constants import REPLAY_MODES
    from moe_lab.rl.dp_split import check_data_parallel
    from moe_lab.rl.loop import train

    root, data = Path(sys.argv[2]), json.loads(sys.argv[3])
    assert "toy_r3" in REPLAY_MODES
    tables = {}
    for mode in ("toy_r3", "rollout", "none"):
        data["rl"]["replay"] = mode
        cfg = validate(from_dict(data))
        assert train(cfg, root / mode, run_id="r", arm="grpo") == "done"
        table = pd.read_parquet(root / mode / "metrics.parquet")
        tables[mode] = table.drop(columns=["replay", *[c for c in table if c.startswith("perf/")]])  # perf: timings
        if mode == "toy_r3":
            try:
                check_data_parallel(cfg, world=2)
                raise AssertionError("a data-parallel split accepted toy_r3")
            except ConfigError as e:
                assert "rl.replay=toy_r3" in str(e) and "\\n" not in str(e), str(e)

    toy, r3, free = tables["toy_r3"], tables["rollout"], tables["none"]
    first = toy.iloc[0]
    assert first["mismatch/expert_change"] > 0  # the rollout's routes are not the trainer's own: forcing matters
    assert first["ratio/token_var"] == 0.0 and first["clip_frac/out_of_range"] == 0.0  # logp == logp_old
    pd.testing.assert_frame_equal(toy, r3, check_exact=True)  # R3 bit for bit
    # the same rollouts at step 0; the old-policy pass follows them under toy_r3 and routes freely under none
    assert toy["mismatch/k3"].iloc[0] != free["mismatch/k3"].iloc[0]
    print("replay mode ok")
""")


def test_the_new_replay_mode_recipe(tmp_path):
    assert "toy_r3" not in (PKG / "config" / "mode_specs.py").read_text(encoding="utf-8")  # the example is new
    pkg = copy_package(tmp_path)
    insert(pkg / "config" / "mode_specs.py", ANCHOR, block("replay-row"), before=False)
    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))["base"]
    # one mini-batch: the first update sees the whole rollout batch, as the old-policy pass did; 128 responses:
    # enough tokens for the bf16 rollout's routing to differ from the trainer's somewhere
    config = apply_overrides(smoke, [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=2", "rl.algo=grpo",
                                     "rl.rollout_dtype=bfloat16", "rl.minibatches=1", "rl.prompts_per_step=16",
                                     "rl.group_size=8", "task.partial_credit=true"])
    done = run_python(tmp_path, ["-c", CHECK, str(pkg), str(tmp_path / "results"), json.dumps(config)])
    assert done.returncode == 0 and "replay mode ok" in done.stdout, done.stderr[-3000:]
