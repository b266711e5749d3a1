"""The project's input error: raised before any work, printed by the CLI as one line (no traceback)."""


class ConfigError(ValueError):
    """Bad input: a config field out of range, unknown or of the wrong type, or an unreadable YAML file; the
    message names the field or the file."""
