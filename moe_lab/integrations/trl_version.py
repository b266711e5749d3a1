"""The TRL versions the integration was tested with, and the one-line refusal of any other (or none)."""

from __future__ import annotations

TESTED_RANGE = (">=1.16", "<1.17")
_LOW, _HIGH = (1, 16), (1, 17)


def require_trl() -> str:
    """TRL's version, or ImportError in one line when TRL is missing or outside TESTED_RANGE."""
    hint = f"moe_lab.integrations.trl needs trl{','.join(TESTED_RANGE)}: pip install -e '.[trl]'"
    try:
        import trl
    except ImportError:
        raise ImportError(f"{hint} (trl is not installed)") from None
    from packaging.version import Version

    version = Version(trl.__version__)
    if not Version("%d.%d" % _LOW) <= version < Version("%d.%d" % _HIGH):
        raise ImportError(f"{hint} (found trl {trl.__version__}, outside the tested range)")
    return trl.__version__
