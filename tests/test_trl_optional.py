"""TRL stays optional: moe_lab imports and its tests run with ``trl`` unimportable, and the integration refuses a
missing or untested TRL in one line. Each check runs in a fresh interpreter where ``import trl`` fails (or finds
a stand-in of another version); none needs TRL installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "import sys; sys.modules['trl'] = None  # import trl -> ImportError\n"
FAKE = "import sys, types; sys.modules['trl'] = types.SimpleNamespace(__version__='1.15.2')\n"


def python(prelude: str, body: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``prelude`` (what trl is in that process) then ``body`` in a fresh interpreter at the repo root."""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_moe_lab_imports_without_trl():
    done = python(BLOCK, """
        import moe_lab, moe_lab.rl.loop, moe_lab.routing, moe_lab.algos.losses, moe_lab.cli, moe_lab.integrations
        assert 'trl' not in sys.modules or sys.modules['trl'] is None
        print('ok')
    """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_integration_without_trl_says_how_to_install_in_one_line():
    done = python(BLOCK, "import moe_lab.integrations.trl\n")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("ImportError: ")
    assert "pip install 'trl>=1.16,<1.17'" in last and "'moe_lab[trl]'" in last and "not installed" in last


def test_the_integration_refuses_an_untested_trl_version():
    done = python(FAKE, "import moe_lab.integrations.trl\n")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("ImportError: ")
    assert "found trl 1.15.2" in last and "trl>=1.16,<1.17" in last


def test_moe_labs_own_tests_pass_without_trl():
    """A sample of the suite that touches routing, metrics and the RL step, in a process where trl cannot load."""
    done = python(BLOCK, """
        import pytest
        sys.exit(pytest.main(['-q', '-p', 'no:randomly', '-p', 'no:cacheprovider', 'tests/test_architecture.py',
                              'tests/test_routing_metrics.py', 'tests/test_honest_metrics.py', '-x']))
    """, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
