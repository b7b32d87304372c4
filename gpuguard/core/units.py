"""Byte sizes as people read them: the one formatter of every message, Event, table and log.

Pure, standard library only. Must not parse (``kubemodel.quantity`` parses).
"""

from __future__ import annotations

_BINARY = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def format_bytes(value: int) -> str:
    """``8Gi`` when ``value`` is an exact multiple of a binary unit; otherwise the exact number
    of bytes followed by an approximation, ``8815083110 bytes (8.21Gi)``; below 1 KiB
    ``512 bytes``.

    The first word is always an exact Kubernetes quantity a user can paste into the annotation.
    """
    for suffix, power in _BINARY:
        if value >= 1 << power and value % (1 << power) == 0:
            return f"{value >> power}{suffix}"
    for suffix, power in _BINARY:
        if value >= 1 << power:
            return f"{value} bytes ({value / (1 << power):.3g}{suffix})"
    return f"{value} bytes"
