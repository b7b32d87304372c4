"""Problems found in a user's document: a stable code, where, and a sentence.

Owns the one shape the pure validators (``core.selector``, ``core.sharing``,
``core.nvidia_configs``) report in: codes are stable snake_case (tests and tools match on them),
``path`` says where in the document (``rules[2].nodeSelector.matchExpressions[0].operator``),
``message`` says what is wrong without quoting more than a shortened value. Must not raise, log
or format for a particular output: the command renders problems.
"""

from __future__ import annotations

from dataclasses import dataclass

_SHOWN_CHARS = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One error or warning in a document."""

    code: str
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{where}{self.message} ({self.code})"


class Problems:
    """Collects a document's errors and warnings while a validator walks it (all at once)."""

    def __init__(self) -> None:
        self.errors: list[Problem] = []
        self.warnings: list[Problem] = []

    def error(self, code: str, path: str, message: str) -> None:
        self.errors.append(Problem(code=code, path=path, message=message))

    def warn(self, code: str, path: str, message: str) -> None:
        self.warnings.append(Problem(code=code, path=path, message=message))


def shown(value: object) -> str:
    """``repr(value)`` cut to a few dozen characters: safe for hostile values in a message."""
    if isinstance(value, str | int | float | bool) or value is None:
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN_CHARS else f"{text[: _SHOWN_CHARS - 1]}…"


def type_name(value: object) -> str:
    """``a string``, ``a list``, ``a mapping``: the YAML type of ``value``, for messages."""
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    for kind, name in names.items():
        if type(value) is kind:
            return name
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else f"a {type(value).__name__}"
