"""Parsers of the ``[limits]`` keys: limits and sizes as quantities, the limit sources, and
gpushare's unit (docs/design.md, Limit sources).

Owns what a limit setting may hold and the words that refuse the rest, with each parser's rule
for the Helm chart's checkers (``CHECKER_RULES``). The quantity grammar itself is
``kubemodel.quantity``'s and the smallest limit ``core.limits``': this module only applies
them. Must not resolve a pod's limit (``core.limits`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gpuguard.config.messages import render
from gpuguard.config.parsers import Invalid, Parser
from gpuguard.core.limits import MIN_LIMIT_BYTES, percent_below_minimum
from gpuguard.core.model import FOREIGN_SOURCES, GPUGUARD_SOURCE, LimitValue
from gpuguard.kubemodel.quantity import (
    InvalidQuantity,
    parse_limit,
    parse_quantity_bytes,
)

SOURCE_NAMES: Final = (GPUGUARD_SOURCE, *(s.value for s in FOREIGN_SOURCES))
GPUSHARE_UNITS: Final = {"GiB": 1 << 30, "MiB": 1 << 20}
"""gpushare's unit names → bytes."""


_SOURCES_ALLOWED = "must be a list of limit sources, each once, from " + ", ".join(
    f'"{n}"' for n in SOURCE_NAMES
)
_SOURCES_EMPTY = ' (default ["gpuguard"])'
_SOURCES_UNKNOWN = "; unknown: {values}"
_SOURCES_TWICE = "; listed twice: {values}"


def limit_sources(raw: object, text: bool) -> tuple[str, ...]:
    """``limits.sources``: known names, each once, in any order (docs/design.md, Limit sources:
    every listed declaration caps the limit and the smallest binds, so the order is no precedence;
    it only picks which name ``source`` shows on a tie)."""
    if text and isinstance(raw, str):
        raw = [part.strip() for part in raw.split(",")]
    if not isinstance(raw, list | tuple) or not raw:
        raise Invalid(_SOURCES_ALLOWED + _SOURCES_EMPTY)
    bad = [item for item in raw if item not in SOURCE_NAMES]
    if bad:
        unknown = ", ".join(render(b) for b in bad)
        raise Invalid(_SOURCES_ALLOWED + _SOURCES_UNKNOWN.format(values=unknown))
    if len(set(raw)) != len(raw):
        twice = ", ".join(sorted({str(n) for n in raw if raw.count(n) > 1}))
        raise Invalid(_SOURCES_ALLOWED + _SOURCES_TWICE.format(values=twice))
    return tuple(str(item) for item in raw)


_GPUSHARE_UNIT_ALLOWED = 'must be "GiB" (gpushare\'s default) or "MiB"'


def gpushare_unit_name(raw: object, text: bool) -> str:
    if isinstance(raw, str) and raw in GPUSHARE_UNITS:
        return raw
    raise Invalid(_GPUSHARE_UNIT_ALLOWED)


_LIMIT_ALLOWED = 'must be a quantity string such as "8Gi" or a percentage such as "25%"'
PERCENT_BELOW_MINIMUM = (
    "{value} resolves below the smallest limit of 1Mi even on a 1Ti device: a limit nothing can "
    "stay under would stop every GPU pod"
)


def limit(raw: object, text: bool) -> LimitValue | None:
    if raw == "":
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise Invalid(_LIMIT_ALLOWED)
    try:
        value = parse_limit(raw)
    except InvalidQuantity as error:
        raise Invalid(_reason(error)) from None
    if value.percent is not None and percent_below_minimum(value.percent):
        raise Invalid(PERCENT_BELOW_MINIMUM.format(value=raw))
    return value


_SIZE_ALLOWED = 'must be 0 or a quantity string such as "2Gi"'


def size_bytes(raw: object, text: bool) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise Invalid(_SIZE_ALLOWED)
    try:
        return parse_quantity_bytes(raw)
    except InvalidQuantity as error:
        if error.code == "zero":  # "0", "0Mi": no reserve is a valid choice here
            return 0
        raise Invalid(_reason(error)) from None


def _reason(error: InvalidQuantity) -> str:
    """The quantity parser's message without its leading quoted value (ours names it already)."""
    message = str(error)
    quoted = repr(error.text)
    if message.startswith(quoted):
        message = message[len(quoted) :].lstrip()
    return message


_QUANTITY_RULE = {"kind": "quantity", "percent": False, "zero": False, "empty": False}
CHECKER_RULES: Final[Mapping[Parser, Mapping[str, Any]]] = {
    gpushare_unit_name: {"kind": "enum", "values": list(GPUSHARE_UNITS),
                    "allowed": _GPUSHARE_UNIT_ALLOWED},
    limit: {**_QUANTITY_RULE, "percent": True, "empty": True, "min_bytes": MIN_LIMIT_BYTES,
            "allowed": _LIMIT_ALLOWED},
    size_bytes: {**_QUANTITY_RULE, "zero": True, "min_bytes": 0, "allowed": _SIZE_ALLOWED},
    limit_sources: {"kind": "sources", "values": list(SOURCE_NAMES),
                    "allowed": _SOURCES_ALLOWED, "empty": _SOURCES_EMPTY,
                    "unknown": _SOURCES_UNKNOWN, "twice": _SOURCES_TWICE},
}  # fmt: skip
"""The checkers' rule of each parser above."""
