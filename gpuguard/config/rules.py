"""The loader's rules as data (``checker_rules``), for the Helm chart's checkers.

Owns turning the parsers, the cross-key checks and their messages into JSON-ready data. Must not
state a rule of its own: every bound, pattern and message comes from the module that applies it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final

from gpuguard.config import limit_fields, parsers
from gpuguard.config.checks import (
    DEFAULT_ABOVE_MAX,
    FAST_ABOVE_POLL,
    STALE,
    STALENESS_BOUNDS,
)
from gpuguard.config.limit_fields import PERCENT_BELOW_MINIMUM
from gpuguard.config.parsers import DNS_LABEL, NOT_A_NAMESPACE, Choice, Number, Parser
from gpuguard.config.settings import SECTIONS, NamespaceSettings, plain
from gpuguard.core.limits import (
    LARGEST_DEVICE_BYTES,
    MIN_LIMIT_BYTES,
    percent_below_minimum,
)
from gpuguard.kubemodel.quantity import checker_grammar

_FUNCTION_RULES: Final[Mapping[Parser, Mapping[str, Any]]] = {
    **parsers.CHECKER_RULES,
    **limit_fields.CHECKER_RULES,
}
"""The rule of each parser that is a plain function (``Number`` and ``Choice`` carry their own);
a new parser without one fails ``checker_rules``."""


def checker_rules() -> dict[str, Any]:
    """What the loader accepts, as JSON-ready data, for checkers that cannot call it: the Helm
    chart's values.schema.json and render-time check (``scripts/gen_values_schema.py`` writes
    both from this, and tests hold them to it).

    ``fields``: section → key → rule, in file order; ``namespace``: the keys of a
    ``[limits.namespaces.<name>]`` table. A rule is ``{"kind", "allowed", "default", ...}``:
    ``allowed`` is the loader's own words, the other entries the kind's bounds, patterns
    (anchored, in the syntax ECMA-262 and Go's RE2 share) or values. Then the cross-key checks and
    their messages, and the quantity grammar (``quantity.checker_grammar``). Messages are
    ``str.format`` templates: each ``{name}`` is filled in as the loader does.
    """
    return {
        "fields": {
            section: {f.name: _checker_rule(f) for f in dataclasses.fields(cls)}
            for section, cls in SECTIONS.items()
        },
        "namespace": {f.name: _checker_rule(f) for f in dataclasses.fields(NamespaceSettings)},
        "namespace_name": {
            "pattern": f"^{DNS_LABEL.pattern}$",
            "message": NOT_A_NAMESPACE,
        },
        "default_above_max": DEFAULT_ABOVE_MAX,
        "staleness": {
            "bounds": [
                {"section": s, "key": k, "factor": f, "what": what, "why": why}
                for s, k, f, what, why in STALENESS_BOUNDS
            ],
            "message": STALE,
        },
        "fast_interval": FAST_ABOVE_POLL,
        "percent_below_minimum": {
            "smallest_percent": _smallest_percent(),
            "message": PERCENT_BELOW_MINIMUM,
        },
        "quantity": checker_grammar(),
    }


def _checker_rule(spec: dataclasses.Field[Any]) -> dict[str, Any]:
    default = (
        plain(spec.default_factory())
        if spec.default_factory is not dataclasses.MISSING
        else plain(spec.default)
    )
    if "parse" not in spec.metadata:  # limits.namespaces: tables, see "namespace"
        return {"kind": "tables", "allowed": "tables [limits.namespaces.<namespace>]"}
    parse = spec.metadata["parse"]
    rule: dict[str, Any]
    if isinstance(parse, Number):
        rule = {
            "kind": "number",
            "minimum": parse.minimum,
            "inclusive": parse.inclusive,
            "maximum": parse.maximum,
            "allowed": parse.allowed,
        }
    elif isinstance(parse, Choice):
        rule = {"kind": "enum", "values": parse.values, "allowed": parse.allowed}
    else:
        rule = dict(_FUNCTION_RULES[parse])
    return {**rule, "default": default}


def _smallest_percent() -> float:
    """The smallest percentage ``percent_below_minimum`` lets through, exactly (a float): below it
    a limit is refused. Found next to ``100 × MIN_LIMIT_BYTES / LARGEST_DEVICE_BYTES``, so that a
    checker comparing with it decides as the float arithmetic of ``percent_below_minimum``."""
    percent = 100 * MIN_LIMIT_BYTES / LARGEST_DEVICE_BYTES
    while percent_below_minimum(percent):
        percent = math.nextafter(percent, math.inf)
    while not percent_below_minimum(below := math.nextafter(percent, 0)):
        percent = below
    return percent
