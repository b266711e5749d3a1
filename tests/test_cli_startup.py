"""The CLI starts without the model stack: `moe-lab --help`, `list` and `config` import neither torch nor
transformers' modeling code (whose fp8/deepgemm/conversion integrations alone take ~1.8 s to import) nor pandas,
and the config copy `moe-lab list` runs ~2000 times equals the YAML round trip it replaced."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from moe_lab.config import apply_overrides

# What `import transformers.modeling_utils` (transformers 5.25) pulls in unconditionally, torch below all of it
MODEL_STACK = ("torch", "transformers.modeling_utils", "transformers.conversion_mapping",
               "transformers.core_model_loading", "transformers.integrations.finegrained_fp8",
               "transformers.integrations.deepgemm")
HEAVY = (*MODEL_STACK, "pandas")  # pandas: only what reads or writes a whole table needs it

PROBE = """
import contextlib, io, json, sys
import moe_lab.cli
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = moe_lab.cli.main(sys.argv[1:])
    except SystemExit as exc:  # --help exits
        code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in json.loads(%r) if m in sys.modules]}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["list"], ["config"]])
def test_light_commands_do_not_import_the_model_stack(argv):
    out = subprocess.run([sys.executable, "-c", PROBE % json.dumps(HEAVY), *argv], check=True,
                         capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["code"] == 0 and got["loaded"] == []


@pytest.mark.parametrize("data", [
    {"b": 1, "a": {"z": [1, 2.5, (3, "x")], "y": None}, "c": True},
    {601: [6010, 6011], 602: [6020]},
    {"mixed": {1: "int key", "s": "str key"}, "f": -0.0, "big": 10 ** 30, "e": "1e-4", "yes": "yes"},
    {"nested": [[{"k": (1,)}], []], "empty": {}},
])
def test_config_copy_equals_the_yaml_round_trip(data):
    before = yaml.safe_dump(data)
    want, got = yaml.safe_load(before), apply_overrides(data, [])
    assert got == want and yaml.safe_dump(got, sort_keys=False) == yaml.safe_dump(want, sort_keys=False)
    _clear_containers(got)  # a deep copy: emptying every container of the copy leaves the original as it was
    assert yaml.safe_dump(data) == before


def _clear_containers(value) -> None:
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    for child in children:
        _clear_containers(child)
    if isinstance(value, (dict, list)):
        value.clear()


def test_config_copy_keeps_nan_and_falls_back_to_yaml_for_other_types():
    import datetime

    data = {"x": float("nan"), "when": datetime.date(2026, 1, 2)}
    got = apply_overrides(data, [])
    assert math.isnan(got["x"]) and got["when"] == yaml.safe_load(yaml.safe_dump(data))["when"]
