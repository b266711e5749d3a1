"""docs/extending.md's recipes, done: each test copies the package, applies a recipe's code blocks exactly as the
page gives them at the places it names, and checks in a fresh interpreter that the result works."""

from __future__ import annotations

import textwrap

import pytest

from recipes import block, copy_package, insert, run_python, write_new_file

OBJECTIVE_CHECK = textwrap.dedent("""
    import dataclasses, sys
    import torch
    import moe_lab
    assert moe_lab.__file__.startswith(sys.argv[1]), moe_lab.__file__  # the copy, not the checkout
    from moe_lab.config import constants as C
    from moe_lab.config import ConfigError, RLConfig, field_table, from_dict, resolved_clip, validate
    from moe_lab.algos.losses import policy_loss
    from moe_lab.algos.objectives import OBJECTIVES, knob_names

    assert C.ALGOS[-1] == "toy_pg" and C.PAPER_CLIP["toy_pg"] == (0.2, 0.27)
    assert all("toy_pg" not in names for names in (C.PPO_CLIP_ALGOS, C.CLIP_LOW_UNBOUNDED, C.TOKEN_CLIP_ALGOS))
    fields = [f.name for f in dataclasses.fields(RLConfig)]
    assert fields[fields.index("vespo_lambda_neg") + 1] == "toy_pg_scale"
    text = "toy_pg: factor on the importance-weighted policy gradient"
    assert ("rl.toy_pg_scale", "1.0", "> 0.0", text) in field_table()
    try:
        validate(from_dict({"rl": {"algo": "toy_pg", "toy_pg_scale": 0.0}}))
        raise AssertionError("rl.toy_pg_scale=0 accepted")
    except ConfigError as exc:
        assert "rl.toy_pg_scale" in str(exc)
    rl = validate(from_dict({"rl": {"algo": "toy_pg", "toy_pg_scale": 2.0}})).rl
    knobs = {name: getattr(rl, name) for name in knob_names(rl.algo)}  # as rl/step.py passes them
    assert knobs == {"toy_pg_scale": 2.0} and OBJECTIVES["toy_pg"].reductions

    g = torch.Generator().manual_seed(0)
    new = (torch.randn(4, 6, generator=g, dtype=torch.float64) - 2.0).requires_grad_()
    old = new.detach() + 0.01 * torch.randn(4, 6, generator=g, dtype=torch.float64)  # every ratio inside GRPO's clip
    adv, mask = torch.randn(4, generator=g, dtype=torch.float64), torch.ones(4, 6)
    mask[:, 4:] = 0
    low, high = resolved_clip(rl)
    toy2, metrics = policy_loss(new, old, adv, mask, algo="toy_pg", clip_low=low, clip_high=high, **knobs)
    toy1, _ = policy_loss(new, old, adv, mask, algo="toy_pg", clip_low=low, clip_high=high, toy_pg_scale=1.0)
    grpo, _ = policy_loss(new, old, adv, mask, algo="grpo", clip_low=0.2, clip_high=0.27)
    # Inside the clip range GRPO's surrogate is w A, so toy_pg at scale 1 is GRPO exactly, and scale 2 doubles it.
    assert torch.equal(toy1, grpo) and torch.equal(toy2, 2 * toy1), (toy1, grpo, toy2)
    grad_toy, = torch.autograd.grad(toy1, new)
    grad_grpo, = torch.autograd.grad(grpo, new)
    assert torch.equal(grad_toy, grad_grpo)
    assert "objective/toy_pg_weight_mean" in metrics
    print("toy_pg ok")
""")


def test_the_new_objective_recipe(tmp_path):
    pkg = copy_package(tmp_path)
    insert(pkg / "config" / "objective_specs.py", "\n)\n\n\ndef spec_table(", "\n" + block("objective-row").rstrip("\n"),
            before=True)
    insert(pkg / "algos" / "objectives.py", "OBJECTIVES: dict[str, Objective] = _REGISTRY.complete()",
            block("objective-function") + "\n\n", before=True)
    done = run_python(tmp_path, ["-c", OBJECTIVE_CHECK, str(pkg)])
    assert done.returncode == 0 and "toy_pg ok" in done.stdout, done.stderr


@pytest.mark.parametrize("missing", ["row", "function"])
def test_half_a_new_objective_fails_at_import(tmp_path, missing):
    pkg = copy_package(tmp_path)
    if missing == "function":
        insert(pkg / "config" / "objective_specs.py", "\n)\n\n\ndef spec_table(", "\n" + block("objective-row").rstrip("\n"),
                before=True)
    else:
        insert(pkg / "algos" / "objectives.py", "OBJECTIVES: dict[str, Objective] = _REGISTRY.complete()",
                block("objective-function") + "\n\n", before=True)
    done = run_python(tmp_path, ["-c", "import moe_lab.algos.objectives"])
    assert done.returncode != 0 and "toy_pg" in done.stderr.strip().splitlines()[-1], done.stderr


def test_the_new_command_recipe(tmp_path):
    pkg = copy_package(tmp_path)
    write_new_file(pkg.parent, "command-module")
    insert(pkg / "cli.py", '    "moe_lab.commands.list_experiments",\n', block("command-line"), before=False)
    done = run_python(tmp_path, ["-m", "moe_lab.cli", "algos", "--ppo-clip"])
    from moe_lab.config import constants as C

    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [x for a in C.PPO_CLIP_ALGOS for x in (a, *(f"{v:g}" for v in C.PAPER_CLIP[a]))]
    helped = run_python(tmp_path, ["-m", "moe_lab.cli", "--help"])
    assert "algos (moe_lab.commands.algos)" in " ".join(helped.stdout.split())
    bad = run_python(tmp_path, ["-m", "moe_lab.cli", "algos", "rl.steps=3"])  # no FIELD=VALUE for this command
    assert bad.returncode == 2 and "unrecognized arguments: rl.steps=3" in bad.stderr
