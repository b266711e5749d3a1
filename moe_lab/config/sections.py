"""How a flat config is made of sections: each section a frozen dataclass that declares its own fields, the
config the flat union of its sections' fields.

The keys stay flat (``rl.collapse_window``, not ``rl.collapse.window``): they are the interface of every
experiment file, command-line override and committed ``config.yaml`` (over a thousand), so a section is a group
of fields declared together, not a level of nesting. ``flat`` builds the config class from its sections (a name
declared in two of them fails at import); ``cfg.section(name)`` is that section's frozen dataclass with the
config's values, what the trainer hands the part that reads it (the expert-bias updates get ``bias``, the
collapse rules ``collapse``); ``moe-lab config`` and docs/config.md list the fields section by section, under
each section's docstring.
"""

from __future__ import annotations

import dataclasses
import typing


def section(name: str):
    """Class decorator: a frozen dataclass of settings, the section ``name`` of a flat config."""
    def make(cls: type) -> type:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.SECTION = name
        return cls
    return make


def _section(self, name: str):
    """Section ``name`` of these settings as a frozen dataclass: what the trainer hands the part reading it."""
    cls = type(self).SECTIONS.get(name)
    if cls is None:
        raise KeyError(f"no section {name!r}; allowed: {', '.join(type(self).SECTIONS)}")
    return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})


def flat(name: str, sections: tuple[type, ...], doc: str, module: str) -> type:
    """A mutable dataclass ``name`` with every field of ``sections``, in their order, the flat keys of a config;
    ``SECTIONS`` (name -> section class), ``SECTION_OF`` (field -> section name) and ``section(name)`` with it."""
    spec, section_of = [], {}
    for cls in sections:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in section_of:
                raise TypeError(f"{name}.{f.name}: declared in section {section_of[f.name]!r} and {cls.SECTION!r}")
            section_of[f.name] = cls.SECTION
            spec.append((f.name, hints[f.name], dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                                   metadata=f.metadata)))
    out = dataclasses.make_dataclass(name, spec, namespace={
        "__doc__": doc, "__module__": module, "section": _section,
        "SECTIONS": {cls.SECTION: cls for cls in sections}, "SECTION_OF": section_of})
    out.__qualname__ = name
    return out
