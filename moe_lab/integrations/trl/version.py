"""The TRL versions the integration was tested with, and the one-line refusal of any other (or none).

``MOE_LAB_ALLOW_UNTESTED_TRL=1`` turns the refusal of an installed TRL outside the tested range into one
warning (a missing TRL is still refused: there is nothing to run)."""

from __future__ import annotations

import functools
import os
import warnings

TESTED_RANGE = (">=1.16", "<1.17")
_LOW, _HIGH = (1, 16), (1, 17)
ALLOW_ENV = "MOE_LAB_ALLOW_UNTESTED_TRL"


@functools.cache  # every module of the package asks; the override's warning is said once per process
def require_trl() -> str:
    """TRL's version, or ImportError in one line when TRL is missing or (unless MOE_LAB_ALLOW_UNTESTED_TRL=1)
    outside TESTED_RANGE."""
    spec = f"trl{','.join(TESTED_RANGE)}"
    hint = f"moe_lab.integrations.trl needs {spec}: pip install '{spec}' (or pip install 'moe_lab[trl]')"
    try:
        import trl
    except ImportError:
        raise ImportError(f"{hint} (trl is not installed)") from None
    from packaging.version import Version

    version = Version(trl.__version__)
    if Version("%d.%d" % _LOW) <= version < Version("%d.%d" % _HIGH):
        return trl.__version__
    found = f"found trl {trl.__version__}, outside the tested range"
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(f"moe_lab.integrations.trl: {found} ({spec}); running anyway because {ALLOW_ENV}=1: "
                      "TRL's hooks it overrides may have changed", stacklevel=2)
        return trl.__version__
    raise ImportError(f"{hint} ({found}; {ALLOW_ENV}=1 runs it anyway with a warning)")
