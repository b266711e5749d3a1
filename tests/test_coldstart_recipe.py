"""A results folder keeps each cold start's recipe and digest, not its weights (moe_lab.rl.coldstart_recipe): the
runner writes them; on resume it re-makes a cold start missing from the cache, says so, and gets the recorded
digest bit for bit; `moe-lab verify` re-makes it and compares the digest (other weights on the same processor
fail, on another processor the line says so); a missing or tampered recipe is named in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lab.cli import main
from moe_lab.config import ConfigError, apply_overrides, load_yaml
from moe_lab.launch.runner import run_experiment
from moe_lab.launch.spec import parse_experiment
from moe_lab.rl.coldstart import cache_key, cache_root
from moe_lab.rl.coldstart_recipe import recipe_config, weights_digest
from moe_lab.store.run_folder import ResultsFolder

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:cold start stopped at coldstart.max_steps")
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))


def _experiment(cache: Path) -> dict:
    # a cold start that trains 4 supervised steps (target 1.0 is never reached), so its weights are not the init
    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={cache}", "rl.steps=1", "coldstart.max_steps=4",
                                           "coldstart.target_accuracy=1.0", "coldstart.eval_every=2",
                                           "coldstart.batch_size=8", "coldstart.eval_samples=8"])
    return {"name": "recipe_test", "base": base, "arms": {"grpo": {"rl": {"algo": "grpo"}}}, "seeds": [0, 1]}


def _quiet(*_):
    return None


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(experiment, results folder, cache entry): seed 0 of a one-arm experiment run; seed 1 left to a resume."""
    tmp = tmp_path_factory.mktemp("recipe")
    exp = _experiment(tmp / "cache")
    statuses = run_experiment(exp, tmp / "exp", jobs=1, seeds=[0], progress=False, echo=_quiet)
    assert statuses == {"grpo-s0": "done"}
    cfg = parse_experiment(exp).cells()[0].config
    return exp, tmp / "exp", cache_root(cfg) / cache_key(cfg)


def _recipe_path(folder: Path) -> Path:
    (path,) = ResultsFolder(folder).coldstarts_dir.glob("*.json")
    return path


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(folder, out)
    return out


def _edit_recipe(folder: Path, edit) -> dict:
    path = _recipe_path(folder)
    recipe = json.loads(path.read_text())
    edit(recipe)
    path.write_text(json.dumps(recipe))
    return recipe


def test_the_runner_commits_the_recipe_and_the_digest_of_the_weights_not_the_weights(made):
    exp, folder, entry = made
    recipe = json.loads(_recipe_path(folder).read_text())
    assert _recipe_path(folder).name == f"{entry.name}.json" and recipe["key"] == entry.name
    assert recipe["digest"] == weights_digest(entry) and recipe["steps"] == 4
    assert not list(ResultsFolder(folder).coldstarts_dir.glob("*/"))  # no weights in the results folder
    # the recipe alone names the cold start: its sections give back the key
    assert cache_key(recipe_config(recipe, cache_dir=entry.parent)) == recipe["key"]
    assert recipe["seed"] == parse_experiment(exp).cells()[0].config.model.seed


def test_the_digest_is_of_the_weights_one_bit_changes_it(made, tmp_path):
    _, _, entry = made
    copy = tmp_path / "entry"
    shutil.copytree(entry, copy)
    (weights,) = copy.glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    flat = tensors[name].reshape(-1).view(torch.int16 if tensors[name].element_size() == 2 else torch.int32)
    flat[0] ^= 1  # the lowest bit of one value
    save_file(tensors, weights, metadata={"format": "pt"})
    assert weights_digest(copy) != weights_digest(entry)


def test_a_resume_re_makes_a_missing_cold_start_says_so_and_gets_the_recorded_digest(made, tmp_path):
    exp, folder, entry = made
    out = _copy(folder, tmp_path)
    recipe_text = _recipe_path(out).read_text()
    moved = tmp_path / "moved"
    shutil.move(entry, moved)  # the weights gone from this machine's cache
    try:
        lines = []
        statuses = run_experiment(exp, out, jobs=1, progress=False, echo=lines.append)
        assert statuses == {"grpo-s0": "done", "grpo-s1": "done"}
        assert any(f"cold start {entry.name[:12]}: not in the cache" in ln and "re-making it from its recipe" in ln
                   for ln in lines), lines
        assert weights_digest(entry) == json.loads(recipe_text)["digest"]  # bit-exact on this machine
        assert _recipe_path(out).read_text() == recipe_text
    finally:
        if not entry.exists():
            shutil.move(moved, entry)


def test_a_resume_refuses_other_weights_on_the_same_processor(made, tmp_path):
    exp, folder, _ = made
    out = _copy(folder, tmp_path)
    shutil.rmtree(out / "runs" / "grpo-s0")  # one cell to run, so the cold start is needed
    _edit_recipe(out, lambda r: r.update(digest="sha256:" + "0" * 64))
    with pytest.raises(ConfigError, match=r"digest \w{12} against the recipe's 000000000000 on the same processor"):
        run_experiment(exp, out, jobs=1, progress=False, echo=_quiet)


def _verify(capsys, folder: Path, *argv: str) -> tuple[int, list[str], str]:
    code = main(["verify", str(folder), "--cells", "1", "--steps", "1", *argv])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_verify_re_makes_the_cold_start_from_its_recipe_with_the_same_digest(made, capsys):
    _, folder, entry = made
    code, lines, err = _verify(capsys, folder)
    assert code == 0 and len(lines) == 1 and "bit-identical" in lines[0]
    assert f"cold start {entry.name[:12]} re-made with its recipe's digest" in lines[0]
    assert f"cold start {entry.name[:12]}: weights not committed; re-making it from its recipe" in err


def test_verify_says_a_tampered_digest_on_the_same_processor_and_fails(made, tmp_path, capsys):
    out = _copy(made[1], tmp_path)
    _edit_recipe(out, lambda r: r.update(digest="sha256:" + "f" * 64))
    code, lines, _ = _verify(capsys, out)
    assert code == 1 and "against the recipe's ffffffffffff on the same processor" in lines[0]


def test_verify_says_different_processor_when_the_recipe_was_made_on_another(made, tmp_path, capsys):
    out = _copy(made[1], tmp_path)
    _edit_recipe(out, lambda r: r.update(digest="sha256:" + "f" * 64,
                                         processor={**r["processor"], "model_name": "Other CPU 9000"}))
    code, lines, _ = _verify(capsys, out)
    assert code == 0 and "different processor (model_name: 'Other CPU 9000' vs" in lines[0]


def test_verify_names_a_missing_recipe_in_one_line_and_exits_2(made, tmp_path, capsys):
    out = _copy(made[1], tmp_path)
    path = _recipe_path(out)
    path.unlink()
    code, lines, err = _verify(capsys, out)
    assert code == 2 and lines == [] and len(err.strip().splitlines()) == 1
    assert err.startswith(f"moe-lab: error: {path}: missing: run grpo-s0 began from cold start")


def test_git_ignores_new_cold_start_weights_under_results_but_not_their_recipes():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    key = "0" * 64
    weights = f"results/reference/new_exp/coldstarts/{key}/model.safetensors"
    recipe = f"results/reference/new_exp/coldstarts/{key}.json"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", weights, recipe], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert ignored == [weights]
