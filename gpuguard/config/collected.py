"""What the sources said so far: each key's parsed value, where it came from, and every problem.

Owns the one place a raw value meets its field's parser, so that every source (file,
environment, flags) words a refused value the same way. Must not read a source: ``file`` and
``overlay`` read them into a ``Collected``, and a later source's value replaces an earlier one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gpuguard.config.messages import render
from gpuguard.config.parsers import Invalid
from gpuguard.config.settings import SECTIONS, Key, NamespaceSettings


@dataclass(slots=True)
class Collected:
    problems: list[str] = field(default_factory=list)
    values: dict[Key, Any] = field(default_factory=dict)
    """``(section, key)`` → its parsed value, from the latest source that set it."""
    origins: dict[Key, str] = field(default_factory=dict)
    """``(section, key)`` → the latest source that set it (also when its value was refused)."""
    namespaces: dict[str, NamespaceSettings] = field(default_factory=dict)
    """``[limits.namespaces.<namespace>]`` tables (file only)."""

    def record(self, section: str, key: str, raw: object, *, text: bool, origin: str) -> None:
        """Parse ``raw`` for ``section.key`` (``text``: it came as a string from the environment
        or a flag) and keep it, or note the problem and forget any earlier value."""
        spec = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[key]
        self.origins[(section, key)] = origin
        try:
            self.values[(section, key)] = spec.metadata["parse"](raw, text)
        except Invalid as problem:
            self.problems.append(refused(origin, f"{section}.{key}", raw, problem))
            self.values.pop((section, key), None)

    def failed_keys(self) -> frozenset[Key]:
        """Keys whose latest value was refused."""
        return frozenset(key for key in self.origins if key not in self.values)


def refused(origin: str, name: str, raw: object, problem: Invalid) -> str:
    """A refused value's problem: ``<origin>: <name> = <value>: <what is allowed>``."""
    return f"{origin}: {name} = {render(raw)}: {problem}"
