"""How configuration problems are worded: a value as TOML spells it, a key as TOML writes it, and
the allowed name a typo most likely meant.

Owns the wording every parser and every source of the package shares. A value or name quoted
from the file or the environment is escaped (``core.text.printable``, after JSON's quoting): a
message holds no control character, bidi override or line separator, wherever it is shown. Must
not decide what is valid.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable

from gpuguard.core.text import printable


def render(value: object) -> str:
    """A value as TOML would spell it, for messages (strings quoted, booleans lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:60] + "…"
        # JSON escapes C0 controls, quotes and backslashes; printable the rest (DEL, C1, U+202E).
        return printable(json.dumps(shown, ensure_ascii=False))
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{…}"
    if isinstance(value, list):
        return "[" + ", ".join(render(v) for v in value[:5]) + (", …]" if len(value) > 5 else "]")
    return type(value).__name__


SUGGEST_MAX_CHARS = 100
"""Longer names get no suggestion: no key is that long, and comparing costs time."""


def closest(name: object, allowed: Iterable[str]) -> str | None:
    """The allowed name a typo most likely meant (``grace_second`` → ``grace_seconds``), by
    ``difflib``'s similarity ratio of at least 0.6; ``None`` when none is that close."""
    if not isinstance(name, str) or len(name) > SUGGEST_MAX_CHARS:
        return None
    close = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_name(problem: str, suggestion: str | None, allowed: str) -> str:
    """One wording for every unknown name (section, key, variable, flag): ``problem``, then
    ``: did you mean <suggestion>?`` when there is one, then ``(<allowed>)``."""
    meant = "" if suggestion is None else f": did you mean {suggestion}?"
    # ``problem`` quotes the unknown name as written (a TOML key, a variable's name): escaped.
    return printable(f"{problem}{meant} ({allowed})")


def toml_key(name: str) -> str:
    """A TOML key, quoted when it is not bare (and escaped: ``json.dumps`` leaves DEL)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name, re.ASCII) else printable(json.dumps(name))
