"""Reading YAML safely: experiments and configs come from other people, so a file never runs code, and
every way it can be wrong (syntax, duplicate keys, object tags, empty, not a mapping) is one line naming it; and
`section.field=value` overrides, parsed as YAML scalars, applied to a config dict."""

from __future__ import annotations

from typing import Any

import yaml

from moe_lab.config.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports unhashable keys with their position
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(path: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    problem = " ".join(str(getattr(err, "problem", None) or err).split())
    if "could not determine a constructor" in problem:
        problem += " (only plain YAML is allowed: tags that build Python objects are refused)"
    return ConfigError(f"{where}: invalid YAML: {problem}")


def load_yaml(path: str) -> dict:
    """Read YAML with the safe loader: a config from someone else never runs code.

    Refuses, with one line naming the file (and line), a syntax error, a duplicate key, a tag that would build
    a Python object, an empty file and a top level that is not a mapping.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    if data is None:
        raise ConfigError(f"{path}: empty file; expected a mapping (an experiment or a config)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- overrides (section.field=value)


def _parse_scalar(text: str) -> Any:
    value = yaml.safe_load(text) if text.strip() else ""
    if isinstance(value, str):
        try:  # PyYAML reads "1e-4" (no dot) as a string; users mean a number
            return float(value)
        except ValueError:
            pass
    return value


def set_dotted(data: dict, key: str, value: Any) -> None:
    """data[a][b] = value for key 'a.b', creating sections as needed."""
    node = data
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {p} is not a section")
    node[parts[-1]] = value


_SCALARS = (str, int, float, bool, type(None))


def _yaml_copy(value: Any) -> Any:
    """What ``yaml.safe_load(yaml.safe_dump(value))`` returns (a deep copy, tuples as lists, mapping keys sorted
    where they compare, as safe_dump sorts them), without the YAML text: `moe-lab list` copies ~2000 configs.
    Anything but plain mappings, sequences and scalars goes through YAML itself."""
    if type(value) in _SCALARS:
        return value
    if type(value) is dict:
        try:
            keys = sorted(value)
        except TypeError:
            keys = list(value)
        return {k: _yaml_copy(value[k]) for k in keys}
    if type(value) in (list, tuple):
        return [_yaml_copy(v) for v in value]
    return yaml.safe_load(yaml.safe_dump(value))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `section.field=value` overrides (values parsed as YAML scalars) to a config dict."""
    out = _yaml_copy(data or {})
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected the form section.field=value, e.g. rl.algo=gspo")
        key, text = item.split("=", 1)
        set_dotted(out, key, _parse_scalar(text))
    return out
