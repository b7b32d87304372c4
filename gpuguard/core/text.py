"""Text shown to people on a terminal: what others wrote, escaped so it cannot drive it.

Owns ``printable``, the one way every command's human output (tables, per-pod lines, warnings,
errors on stderr) and every message that quotes a name shows text it did not write: pod and
namespace names, annotations, container and claim names, process and cgroup names, file names
and the contents of files. A terminal obeys what it is sent: ``ESC [2K`` erases a line, ``\\r``
and backspace move back over it, ``ESC [A`` climbs to the row above, the C1 control ``\\x9b`` is
a CSI on its own, ``U+202E`` reverses what follows and a newline starts a row of its own, so a
name holding them could draw a fake "ok" row or hide an error. Escaped, they are shown as
Python writes them (``\\x1b[2K``, ``\\r``, ``\\u202e``): still visible, never obeyed.
``display_width`` and ``pad`` align escaped text in columns by the cells it takes.

Must not be used on JSON output (``json.dumps`` already escapes, and JSON carries the exact
value). Standard library only; no I/O.
"""

from __future__ import annotations

import unicodedata


def printable(text: str, *, line_breaks: bool = False) -> str:
    """``text`` with every character that is not printable escaped as Python escapes it in a
    ``repr`` (``\\x1b``, ``\\r``, ``\\t``, ``\\x9b``, ``\\u202e``, ``\\u2028``,
    ``\\U000e0001``); printable text, non-ASCII included, is unchanged, and escaping it again
    changes nothing. ``line_breaks``: keep ``\\n`` as it is (a message of several lines that
    gpuguard wrote itself, each line escaped); otherwise a newline is shown as ``\\n`` too, so
    that text from elsewhere always stays on the line it is shown on.

    A backslash is not escaped: it cannot drive a terminal, and paths and patterns stay
    readable; a name that spells ``\\x1b`` out only looks like an escaped one."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or (line_breaks and ch == "\n") else _escaped(ch) for ch in text
    )


def _escaped(ch: str) -> str:
    # unicode_escape writes \t \n \r and \\xNN, \\uNNNN, \\UNNNNNNNN for the rest.
    return ch.encode("unicode_escape").decode("ascii")


def display_width(text: str) -> int:
    """The terminal cells ``printable`` text takes: 2 for a wide or full-width character (CJK),
    0 for a combining mark, 1 for any other. For aligning columns; ``len`` miscounts both."""
    if text.isascii():
        return len(text)
    return sum(_cells(ch) for ch in text)


def _cells(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def pad(text: str, width: int) -> str:
    """``text`` followed by spaces up to ``width`` cells (``str.ljust`` by ``display_width``)."""
    return text + " " * max(0, width - display_width(text))
