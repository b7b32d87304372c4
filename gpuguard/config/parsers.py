"""Field parsers: one setting's raw value → its typed value, or ``Invalid`` saying what is allowed.

A parser takes the raw value and whether it came as text (environment, flags: ``"2.5"``,
``"true"``, ``"a,b"``) or typed from the TOML file, and returns the typed value. Each section
field names its parser (``parsed_by``). Owns the generic parsers (numbers, booleans, choices,
paths, names, addresses); the ``[limits]`` ones are in ``limit_fields``. Beside each plain
function its rule for the Helm chart's checkers (``CHECKER_RULES``, read by ``rules``). Must not
know where a value came from: the caller names the source.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpuguard.config.address import (
    ADDRESS_FORM,
    InvalidListenAddress,
    parse_listen_address,
)
from gpuguard.config.messages import render


class Invalid(ValueError):
    """A value a parser refuses; ``str()`` is what is allowed."""


Parser = Callable[[object, bool], Any]


def parsed_by(parse: Parser) -> dict[str, Parser]:
    """A field's metadata: the parser of its values."""
    return {"parse": parse}


_NUMBER_TEXT = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)


@dataclass(frozen=True, slots=True, kw_only=True)
class Number:
    """A number ``> minimum`` (``≥`` when ``inclusive``) and, with ``maximum``, ``≤ maximum``;
    ``unit`` names it in the error (seconds, a fraction). A class, not a closure, so that
    ``checker_rules`` can read the bounds."""

    minimum: float
    inclusive: bool
    maximum: float | None = None
    unit: str = "seconds"

    @property
    def allowed(self) -> str:
        if self.maximum is None:
            bound = f"{'≥' if self.inclusive else '>'} {self.minimum:g}"
        elif self.inclusive:
            bound = f"from {self.minimum:g} to {self.maximum:g}"
        else:
            bound = f"> {self.minimum:g} and ≤ {self.maximum:g}"
        return f"must be a number {bound} ({self.unit})"

    def __call__(self, raw: object, text: bool) -> float:
        if text and isinstance(raw, str) and _NUMBER_TEXT.fullmatch(raw):
            raw = float(raw)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise Invalid(self.allowed)
        value = float(raw)
        low = value < self.minimum or (value == self.minimum and not self.inclusive)
        if not math.isfinite(value) or low:
            raise Invalid(self.allowed)
        if self.maximum is not None and value > self.maximum:
            raise Invalid(self.allowed)
        return value


@dataclass(frozen=True, slots=True)
class Choice:
    """One of ``kind``'s values (a class so that ``checker_rules`` can list them)."""

    kind: type[enum.StrEnum]

    @property
    def values(self) -> list[str]:
        return [member.value for member in self.kind]

    @property
    def allowed(self) -> str:
        return "must be one of " + ", ".join(f'"{v}"' for v in self.values)

    def __call__(self, raw: object, text: bool) -> enum.StrEnum:
        if isinstance(raw, str) and raw in self.values:
            return self.kind(raw)
        raise Invalid(self.allowed)


_BOOL_ALLOWED = "must be true or false"


def boolean(raw: object, text: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if text and isinstance(raw, str):
        lowered = raw.strip().lower()
        if lowered in {"true", "1", "yes", "on"}:
            return True
        if lowered in {"false", "0", "no", "off"}:
            return False
    raise Invalid(_BOOL_ALLOWED)


_ABSOLUTE_PATH_ALLOWED = 'must be an absolute path (e.g. "/host/proc")'
_OPTIONAL_PATH_ALLOWED = 'must be a file path, or "" for none'


def absolute_path(raw: object, text: bool) -> Path:
    if isinstance(raw, str) and raw.startswith("/") and "\0" not in raw:
        return Path(raw)
    raise Invalid(_ABSOLUTE_PATH_ALLOWED)


def optional_path(raw: object, text: bool) -> Path | None:
    if raw == "":
        return None
    if isinstance(raw, str) and "\0" not in raw:
        return Path(raw)
    raise Invalid(_OPTIONAL_PATH_ALLOWED)


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", re.ASCII)
"""A namespace name."""
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII
)
NOT_A_NAMESPACE = "{name} is not a namespace name (lower-case DNS label, ≤ 63 characters)"
"""A ``[limits.namespaces.<name>]`` table whose name is not a namespace's."""

_NODE_NAME_ALLOWED = "must be a Kubernetes node name (lower-case DNS subdomain, ≤ 253 characters)"
_NAMESPACE_NAME_ALLOWED = (
    'must be a namespace name (lower-case DNS label, ≤ 63 characters, e.g. "gpuguard")'
)
_OBJECT_NAME_ALLOWED = (
    'must be a ConfigMap name (lower-case DNS subdomain, ≤ 253 characters, e.g. "gpuguard-sharing")'
)


def _subdomain(raw: object, allowed: str) -> str:
    if isinstance(raw, str) and len(raw) <= 253 and _DNS_SUBDOMAIN.fullmatch(raw):
        return raw
    raise Invalid(allowed)


def node_name(raw: object, text: bool) -> str | None:
    if raw == "":
        return None
    return _subdomain(raw, _NODE_NAME_ALLOWED)


def namespace_name(raw: object, text: bool) -> str:
    if isinstance(raw, str) and DNS_LABEL.fullmatch(raw):
        return raw
    raise Invalid(_NAMESPACE_NAME_ALLOWED)


def object_name(raw: object, text: bool) -> str:
    return _subdomain(raw, _OBJECT_NAME_ALLOWED)


_NAMESPACES_ALLOWED = "must be a list of namespace names (lower-case DNS labels, ≤ 63 characters)"
_NOT_VALID = "; not valid: {values}"


def namespace_list(raw: object, text: bool) -> frozenset[str]:
    allowed = _NAMESPACES_ALLOWED + ("; in the environment, comma-separated" if text else "")
    items: list[object]
    if text and isinstance(raw, str):
        # An empty entry is a mistake, never "no exemptions": GPUGUARD_..._NAMESPACES="," once
        # silently un-exempted kube-system and NVIDIA's operands. To exempt nothing,
        # say so in the config file: exempt_namespaces = [].
        items = [part.strip() for part in raw.split(",")]
        if "" in items:
            raise Invalid(
                f"{allowed}; it has an empty entry (to exempt no namespace, set "
                "exempt_namespaces = [] in the config file)"
            )
    elif isinstance(raw, list | tuple | frozenset | set):
        items = list(raw)
    else:
        raise Invalid(allowed)
    bad = [item for item in items if not (isinstance(item, str) and DNS_LABEL.fullmatch(item))]
    if bad:
        raise Invalid(allowed + _NOT_VALID.format(values=", ".join(render(b) for b in bad)))
    return frozenset(str(item) for item in items)


_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL = re.compile(
    rf"(({DNS_LABEL.pattern})(\.({DNS_LABEL.pattern}))*/)?{_LABEL_NAME}=({_LABEL_NAME})?",
    re.ASCII,
)
"""``key=value`` of a Kubernetes label: an optional DNS-subdomain prefix and ``/``, a name of
≤ 63 characters, ``=``, a value of ≤ 63 characters (may be empty). RE2 takes it too (the
chart's check)."""
_LABEL_PREFIX_MAX = 254
"""A label key's prefix with its ``/``: a DNS subdomain is at most 253 characters."""
_LABEL_ALLOWED = (
    'must be "" (none) or one namespace label as key=value, as a label selector writes it '
    '(e.g. "gpuguard.io/exempt=true"; key: an optional DNS-subdomain prefix and /, then ≤ 63 '
    "characters of letters, digits, -, _ and .; value: ≤ 63 such characters)"
)


def _label_prefix(text: str) -> str:
    found = re.match(r"[^/=]*/", text)
    return found.group(0) if found else ""


def namespace_label(raw: object, text: bool) -> str:
    """A label ``key=value``, kept as written; ``""``: none."""
    if raw == "":
        return ""
    if (
        isinstance(raw, str)
        and _LABEL.fullmatch(raw)
        and len(_label_prefix(raw)) <= _LABEL_PREFIX_MAX
    ):
        return raw
    raise Invalid(_LABEL_ALLOWED)


def label_pair(text: str) -> tuple[str, str] | None:
    """``namespace_label``'s value as ``(key, value)``; ``None`` for ``""``."""
    if not text:
        return None
    key, _, value = text.partition("=")
    return key, value


_MPS_GPU = re.compile(
    r"all|GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    re.ASCII,
)
_MPS_GPUS_ALLOWED = (
    'must be a list of GPU UUIDs as NVML and nvidia-smi -L print them ("GPU-" and 32 hex '
    'digits in 8-4-4-4-12 groups), or ["all"]'
)


def gpu_list(raw: object, text: bool) -> frozenset[str]:
    """GPU UUIDs, or ``all``; in the environment comma-separated (an empty entry is an error,
    as for namespaces: to name none, leave the key out)."""
    allowed = _MPS_GPUS_ALLOWED + ("; in the environment, comma-separated" if text else "")
    items: list[object]
    if text and isinstance(raw, str):
        items = [part.strip() for part in raw.split(",")]
    elif isinstance(raw, list | tuple | frozenset | set):
        items = list(raw)
    else:
        raise Invalid(allowed)
    bad = [item for item in items if not (isinstance(item, str) and _MPS_GPU.fullmatch(item))]
    if bad:
        raise Invalid(allowed + _NOT_VALID.format(values=", ".join(render(b) for b in bad)))
    return frozenset(str(item) for item in items)


def listen_address(raw: object, text: bool) -> str:
    """A ``host:port`` that ``parse_listen_address`` takes, kept as written."""
    if not isinstance(raw, str):
        raise Invalid(ADDRESS_FORM)
    try:
        parse_listen_address(raw)
    except InvalidListenAddress as error:
        raise Invalid(error.problem) from None
    return raw


_NAME_RULE = {"kind": "name", "empty": False, "max_length": 253}
CHECKER_RULES: Final[Mapping[Parser, Mapping[str, Any]]] = {
    boolean: {"kind": "boolean", "allowed": _BOOL_ALLOWED},
    namespace_list: {"kind": "namespaces", "pattern": f"^{DNS_LABEL.pattern}$",
                     "allowed": _NAMESPACES_ALLOWED, "not_valid": _NOT_VALID},
    namespace_label: {"kind": "label", "pattern": f"^({_LABEL.pattern})?$",
                      "prefix_max": _LABEL_PREFIX_MAX, "allowed": _LABEL_ALLOWED},
    gpu_list: {"kind": "gpus", "pattern": f"^({_MPS_GPU.pattern})$",
               "allowed": _MPS_GPUS_ALLOWED, "not_valid": _NOT_VALID},
    absolute_path: {"kind": "path", "absolute": True, "allowed": _ABSOLUTE_PATH_ALLOWED},
    optional_path: {"kind": "path", "absolute": False, "allowed": _OPTIONAL_PATH_ALLOWED},
    node_name: {**_NAME_RULE, "pattern": f"^{_DNS_SUBDOMAIN.pattern}$", "empty": True,
                "allowed": _NODE_NAME_ALLOWED},
    namespace_name: {**_NAME_RULE, "pattern": f"^{DNS_LABEL.pattern}$", "max_length": 63,
                     "allowed": _NAMESPACE_NAME_ALLOWED},
    object_name: {**_NAME_RULE, "pattern": f"^{_DNS_SUBDOMAIN.pattern}$",
                  "allowed": _OBJECT_NAME_ALLOWED},
    listen_address: {"kind": "address", "allowed": ADDRESS_FORM},
}  # fmt: skip
"""The checkers' rule of each parser above that is a plain function (``Number`` and ``Choice``
carry their own)."""
