"""quantity: parses GPU memory limits and config sizes exactly as Kubernetes parses quantities.

Owns the text → ``LimitValue`` / bytes translation for the pod annotation
``gpuguard.io/gpu-memory-limit`` (docs/design.md, Limit sources) and for size-valued config keys.
Standard library only (``gpuguard.kubemodel``'s contract): ``_parse_quantity`` is the Python
client's ``kubernetes.utils.parse_quantity``, step for step, so this grammar needs no client;
``tests/test_quantity.py`` holds the two equal. Must not decide anything about limits (that is
``core.limits``), read files or the environment, or log.

Why a grammar check comes first: the Python client's ``parse_quantity`` is more lenient than the
API server. It hands the number to ``decimal.Decimal``, which accepts inner and surrounding
whitespace, ``NaN``, ``Infinity``, underscores (``1_000``) and non-ASCII digits (``１６``). The
API server's quantity grammar (its OpenAPI ``quantity`` pattern, enforced by
``resource.ParseQuantity``) accepts none of those, so we check it first and keep a value the
kubelet would reject from ever becoming a limit.

Semantics, as Kubernetes: binary suffixes ``Ki Mi Gi Ti Pi Ei`` (powers of 1024), decimal
suffixes ``n u m k M G T P E`` (powers of 1000), decimal exponents ``8e9``; a bare number is
**bytes** (``16`` is 16 bytes, not 16 GiB: a limit below 1 MiB is refused as a unit slip).
Fractional bytes round *up*, as ``Quantity.Value()`` does (``1.5`` → 2, ``1m`` → 1). Values above
the int64 range saturate at ``2**63 - 1``, as ``ParseQuantity`` caps binary-SI amounts: such a
limit exceeds every device and is then treated as unlimited (with a warning) by ``core.limits``.
"""

from __future__ import annotations

import decimal
import math
import re
import reprlib
from collections.abc import Mapping

from gpuguard.core.limits import MIN_LIMIT_BYTES
from gpuguard.core.model import LIMIT_ANNOTATION, LimitValue

MAX_BYTES = 2**63 - 1
"""Saturation bound for huge quantities (Kubernetes' int64 cap)."""

MAX_VALUE_CHARS = 64
"""Longest limit or size text accepted. An annotation value may be 256 KiB and a tenant writes
it: anything longer than any real quantity is refused before a regular expression sees it."""

_QUANTITY = re.compile(r"[+-]?[0-9.]++(?:[eEinumkKMGTP]*+[-+]?[0-9]*+)", re.ASCII)
"""The API server's quantity pattern ``^[+-]?[0-9.]+([eEinumkKMGTP]*[-+]?[0-9]*)$`` with
possessive quantifiers: the same language (no character class overlaps the one after it, except
the digits, which the possessive run keeps), but it cannot backtrack. The original form is
quadratic on ``"1" * n + "x"`` (48 k characters: 12 s holding the GIL). Used with
``fullmatch`` (``$`` would accept a final newline)."""

_PERCENT = re.compile(r"([+-]?[0-9]++(?:\.[0-9]++)?)%", re.ASCII)

_BYTE_UNIT = re.compile(r"([0-9.]++)\s*+([kKmMgGtTpPeE])[bB]", re.ASCII)
"""``8GB``, ``8gb``, ``8 GB``: a byte unit that is not a Kubernetes suffix, worth a hint."""

_ALLOWED = (
    "use a positive Kubernetes quantity (8Gi, 8G, 8192Mi, 1.5Gi, 8e9, 8000000000; units "
    "Ki Mi Gi Ti Pi Ei or k M G T P E; a bare number is bytes; no spaces)"
)
_ALLOWED_COUNT = (
    "use a whole positive number, plain or as a Kubernetes quantity (3000, 3k), no unit of "
    "bytes: the scheduler's own unit applies"
)
MAX_COUNT = 1 << 40
"""Largest whole-number declaration read (MiB: a billion TiB)."""
_ALLOWED_PERCENT = " or a percentage > 0 and ≤ 100 of the device's memory (25%, 12.5%)"
_CAUSES = {
    "empty": "is empty",
    "whitespace": "contains whitespace",
    "syntax": "is not a number with a Kubernetes unit",
    "unit": "has an unknown unit",
    "negative": "is negative",
    "zero": "is zero",
    "too_long": f"is longer than {MAX_VALUE_CHARS} characters",
}
_TOO_SMALL = "is {bytes} bytes, below the smallest limit of 1Mi"
_BARE_NUMBER_HINT = " (a bare number is bytes: did you mean {text}Gi?)"
_UNIT_HINT = " (did you mean {number}{prefix}i or {number}{prefix}?)"
_PERCENT_SYNTAX = (
    "is not a valid percentage: use a number > 0 and ≤ 100 followed by %, no spaces (25%, 12.5%)"
)
_PERCENT_RANGE = "is out of range: a percentage must be > 0 and ≤ 100 (25%, 12.5%)"
_PERCENT_NOT_ALLOWED = "is a percentage, not allowed here: " + _ALLOWED
_SHOWN_CHARS = 40

_SUFFIX_EXPONENTS = {
    "n": -3,
    "u": -2,
    "m": -1,
    "k": 1,
    "K": 1,
    "M": 2,
    "G": 3,
    "T": 4,
    "P": 5,
    "E": 6,
}
"""The suffixes ``parse_quantity`` knows, as powers of 1000 (alone; ``K`` is kilo too) or of
1024 (before ``i``, the binary ones only: ``KMGTPE``)."""
_BINARY_PREFIXES = "KMGTPE"
_FORM = (
    r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)"
    rf"([eE][+-]?[0-9]+|[{_BINARY_PREFIXES}]i|[{''.join(_SUFFIX_EXPONENTS)}])?"
)
"""What ``parse_quantity`` takes of the API server's language: a decimal number, then one
exponent or one suffix. ``1ki``, ``1ke3``, ``1.2.3`` and ``1e`` match ``_QUANTITY`` and fail here
("unit" when a digit is followed by a suffix letter, ``_UNIT_LETTER``, else "syntax"). Used only
by checkers outside Python (``checker_grammar``); tests hold it to the parser."""
_UNIT_LETTER = re.compile(r"[0-9][eEinumkKMGTP]", re.ASCII)

_SHORT = reprlib.Repr()
"""``repr`` of a value of any type, bounded in length and depth (a non-string annotation)."""
_SHORT.maxlevel = 2
_SHORT.maxstring = _SHORT.maxother = 16
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 2


class InvalidQuantity(ValueError):
    """A rejected limit or size. ``str()`` is the human reason; ``code`` a stable metric label."""

    def __init__(self, text: str, code: str, reason: str) -> None:
        self.text = text
        self.code = code
        """One of ``empty``, ``whitespace``, ``syntax``, ``unit``, ``zero``, ``negative``,
        ``too_long``, ``too_small``, ``percent_range``, ``percent_not_allowed``."""
        super().__init__(reason)


def show(text: str) -> str:
    """``text`` quoted for a message, shortened: annotations may be up to 256 KiB."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return repr(text[:_SHOWN_CHARS]) + f"… ({len(text)} characters)"


def parse_limit(text: str) -> LimitValue:
    """The pod annotation's value as a limit: bytes, or a percentage of the device's memory.

    Raises ``InvalidQuantity`` (a ``ValueError``) naming the value and what is allowed. A limit
    below ``MIN_LIMIT_BYTES`` (1 MiB) is refused: ``"16"`` is 16 bytes, a CUDA context alone
    takes hundreds of MiB, and a limit nothing can stay under would mean "kill" (docs/design.md,
    Limit sources).
    """
    _check_length(text, allowed=_ALLOWED + _ALLOWED_PERCENT)
    if text.endswith("%"):
        return LimitValue(percent=_parse_percent(text))
    limit_bytes = _parse_bytes(text, allowed=_ALLOWED + _ALLOWED_PERCENT)
    if limit_bytes < MIN_LIMIT_BYTES:
        raise InvalidQuantity(
            text,
            "too_small",
            f"{show(text)} {_TOO_SMALL.format(bytes=limit_bytes)}"
            + (_BARE_NUMBER_HINT.format(text=text) if text.isdigit() else ""),
        )
    return LimitValue(limit_bytes=limit_bytes)


def parse_limit_annotation(
    annotations: Mapping[str, object],
) -> tuple[LimitValue | None, str | None]:
    """``(Pod.annotation_limit, Pod.annotation_error)`` from a pod's annotations: the one reader
    of the limit annotation (API server, pods file, ``check-pod``, the demo).

    ``(None, None)`` when the annotation is absent; ``(None, reason)`` when it is invalid,
    including any value that is not a string (YAML's unquoted ``8`` or ``1.5``).
    """
    if LIMIT_ANNOTATION not in annotations:
        return None, None
    text = annotations[LIMIT_ANNOTATION]
    if not isinstance(text, str):  # a manifest, not the API server, can carry `limit: 8`
        # reprlib: bounded however large or deep the value is (a pods file is not validated).
        return None, f'value {_SHORT.repr(text)} is not a string (quote it in YAML, e.g. "8Gi")'
    try:
        return parse_limit(text), None
    except InvalidQuantity as error:
        return None, str(error)


def parse_quantity_bytes(text: str) -> int:
    """A size-valued config key (same grammar as ``parse_limit``, no percentage): bytes > 0."""
    _check_length(text, allowed=_ALLOWED)
    if text.endswith("%"):
        raise InvalidQuantity(
            text,
            "percent_not_allowed",
            f"{show(text)} {_PERCENT_NOT_ALLOWED}",
        )
    return _parse_bytes(text, allowed=_ALLOWED)


def quantity_above_zero(value: object) -> bool | None:
    """Whether a container's resource quantity (``nvidia.com/gpu: "1"``) is above zero, as the
    API server parses it: ``False`` for ``0``, ``"0"``, ``"0.0"``, ``"0k"``, ``"-1"``; ``True``
    for ``"1"``, ``"500m"``, ``2``. ``None`` when it is not a quantity at all (a string the
    grammar refuses, longer than ``MAX_VALUE_CHARS``, a boolean or any other type): the API
    server never stores one, only a pods file or a manifest can carry it, and the caller decides
    what unknown means (the agent counts it as holding the resource)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return None if math.isnan(value) else value > 0
    if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS:
        return None
    if _QUANTITY.fullmatch(value) is None:
        return None
    with decimal.localcontext() as context:
        context.prec = 120
        context.Emax = decimal.MAX_EMAX
        context.Emin = decimal.MIN_EMIN
        try:
            amount = _parse_quantity(value)
        except (ValueError, decimal.DecimalException):
            return None
        return bool(amount > 0)


def _check_length(text: str, *, allowed: str) -> None:
    if len(text) > MAX_VALUE_CHARS:
        raise InvalidQuantity(text, "too_long", f"{show(text)} {_CAUSES['too_long']}: {allowed}")


def _parse_percent(text: str) -> float:
    match = _PERCENT.fullmatch(text)
    if match is None:
        raise InvalidQuantity(
            text,
            _shape_code(text),
            f"{show(text)} {_PERCENT_SYNTAX}",
        )
    percent = decimal.Decimal(match.group(1))
    if not 0 < percent <= 100:
        code = "negative" if percent < 0 else ("zero" if percent == 0 else "percent_range")
        raise InvalidQuantity(
            text,
            code,
            f"{show(text)} {_PERCENT_RANGE}",
        )
    return float(percent)


def parse_count(text: str) -> int:
    """Another scheduler's whole-number declaration (``nvidia.com/gpumem: 3000``, which the API
    server writes back as ``3k``; KAI's ``gpu-memory`` annotation): a Kubernetes quantity that is
    a positive whole number, at most ``MAX_COUNT``. Raises ``InvalidQuantity``."""
    _check_length(text, allowed=_ALLOWED_COUNT)
    if re.search(r"[KMGTPE]i$", text):
        raise InvalidQuantity(text, "unit", f"{show(text)} has a unit of bytes: " + _ALLOWED_COUNT)
    amount = _parse_decimal(text, allowed=_ALLOWED_COUNT)
    if amount.adjusted() >= 13 or amount > MAX_COUNT:
        raise InvalidQuantity(
            text, "too_large", f"{show(text)} is above {MAX_COUNT}: " + _ALLOWED_COUNT
        )
    if amount != amount.to_integral_value():
        raise InvalidQuantity(
            text, "syntax", f"{show(text)} is not a whole number: " + _ALLOWED_COUNT
        )
    return int(amount)


def _parse_bytes(text: str, *, allowed: str) -> int:
    amount = _parse_decimal(text, allowed=allowed)
    # adjusted() is the decimal exponent of the leading digit: checking it first keeps
    # "1e999999999" from building a billion-digit int.
    if amount.adjusted() >= 19:
        return MAX_BYTES
    return min(int(amount.to_integral_value(rounding=decimal.ROUND_CEILING)), MAX_BYTES)


def _parse_quantity(text: str) -> decimal.Decimal:
    """The Python client's ``parse_quantity`` for a string, step for step (``tests/test_quantity``
    compares the two): a suffix is the last character if it is in ``_SUFFIX_EXPONENTS``, or the
    last two if they end in ``i`` after one of those; the rest goes to ``Decimal`` in the caller's
    context. Raises ``ValueError`` where the client does; any other ``DecimalException`` of
    ``Decimal`` passes through, as there. Run only on text the grammar (``_QUANTITY``) took."""
    number = text
    suffix = ""
    if len(text) >= 2 and text[-1] == "i":
        if text[-2] in _SUFFIX_EXPONENTS:
            number, suffix = text[:-2], text[-2:]
    elif len(text) >= 1 and text[-1] in _SUFFIX_EXPONENTS:
        number, suffix = text[:-1], text[-1:]
    try:
        amount = decimal.Decimal(number)
    except decimal.InvalidOperation:
        raise ValueError(f"invalid number: {number!r}") from None
    if not suffix:
        return amount
    if suffix.endswith("i"):
        if suffix[0] not in _BINARY_PREFIXES:
            raise ValueError(f"{text!r} has an unknown suffix")
        base = 1024
    else:
        base = 1000
    exponent = decimal.Decimal(_SUFFIX_EXPONENTS[suffix[0]])
    try:
        return amount * (base**exponent)
    except decimal.DecimalException as exc:
        raise ValueError(f"invalid quantity: {text!r}") from exc


def _parse_decimal(text: str, *, allowed: str) -> decimal.Decimal:
    """A positive quantity as Kubernetes parses it, exactly (a ``Decimal``)."""
    if _QUANTITY.fullmatch(text) is None:
        code = _shape_code(text)
        hint = ""
        if (unit := _BYTE_UNIT.fullmatch(text)) is not None:
            code = "unit"
            number, prefix = unit.group(1), unit.group(2).upper().replace("K", "k")
            hint = _UNIT_HINT.format(number=number, prefix=prefix)
        raise InvalidQuantity(text, code, f"{show(text)} {_CAUSES[code]}{hint}: {allowed}")
    # Enough precision that any value below the int64 cap is computed exactly (the default 28
    # digits would round e.g. 1.2345678901234567890123456Ei).
    with decimal.localcontext() as context:
        context.prec = 120
        context.Emax = decimal.MAX_EMAX
        context.Emin = decimal.MIN_EMIN
        try:
            amount = _parse_quantity(text)
        except (ValueError, decimal.DecimalException):
            # The grammar passed: the suffix or the dots are wrong ("1ki", "1ke3", "1.2.3").
            code = "unit" if _UNIT_LETTER.search(text) else "syntax"
            raise InvalidQuantity(text, code, f"{show(text)} {_CAUSES[code]}: {allowed}") from None
        if amount.is_zero():
            raise InvalidQuantity(text, "zero", f"{show(text)} {_CAUSES['zero']}: {allowed}")
        if amount < 0:
            raise InvalidQuantity(
                text, "negative", f"{show(text)} {_CAUSES['negative']}: {allowed}"
            )
        return amount


def _shape_code(text: str) -> str:
    """A metric-friendly reason for a value that fails the grammar."""
    if text == "":
        return "empty"
    if text != text.strip() or any(c.isspace() for c in text):
        return "whitespace"
    if text.startswith("-") and len(text) > 1 and text[1].isascii() and text[1].isdigit():
        return "negative"
    return "syntax"


def checker_grammar() -> dict[str, object]:
    """This module's grammar and messages as data, for checkers that cannot call it (the Helm
    chart's render-time check, through ``gpuguard.config.checker_rules``).

    Patterns are anchored, in the subset of syntax ECMA-262 and Go's RE2 share: ``api`` is the
    API server's quantity pattern (``_QUANTITY`` without its possessive quantifiers), ``form``
    what ``parse_quantity`` then takes of it; ``percent`` and ``byte_unit`` as above. Messages
    are what follows the quoted value in ``InvalidQuantity``'s text; ``{name}`` fields are
    filled in as here. ``whitespace`` is RE2 only: the characters ``str.isspace`` takes.
    """
    return {
        "max_chars": MAX_VALUE_CHARS,
        "api": _anchored(_QUANTITY.pattern),
        "form": _anchored(_FORM),
        "unit_letter": _UNIT_LETTER.pattern,
        "percent": _anchored(_PERCENT.pattern),
        "byte_unit": _anchored(_BYTE_UNIT.pattern),
        "whitespace": r"[\t-\r\x{1c}-\x{1f}\x{85}\p{Z}]",
        "decimal_exponents": {suffix: 3 * power for suffix, power in _SUFFIX_EXPONENTS.items()},
        "binary_factors": {
            f"{prefix}i": 1024 ** _SUFFIX_EXPONENTS[prefix] for prefix in _BINARY_PREFIXES
        },
        "max_bytes": MAX_BYTES,
        # Beyond these Decimal refuses the text (what is left is "unit" or "syntax", as when
        # parse_quantity fails): the adjusted exponent above MAX_EMAX, the exponent below
        # MIN_ETINY. Strings: a JSON number would round them.
        "adjusted_max": str(decimal.MAX_EMAX),
        "exponent_min": str(decimal.MIN_ETINY),
        "causes": dict(_CAUSES),
        "allowed": _ALLOWED,
        "allowed_percent": _ALLOWED_PERCENT,
        "too_small": _TOO_SMALL,
        "bare_number_hint": _BARE_NUMBER_HINT,
        "unit_hint": _UNIT_HINT,
        "percent_syntax": _PERCENT_SYNTAX,
        "percent_range": _PERCENT_RANGE,
        "percent_not_allowed": _PERCENT_NOT_ALLOWED,
    }


def _anchored(pattern: str) -> str:
    """``pattern`` for a whole-string match outside Python: possessive quantifiers dropped (the
    language is the same; ECMA-262 has none, and RE2 cannot backtrack anyway), ``^…$`` added."""
    return "^" + re.sub(r"(?<=[+*?}])\+", "", pattern) + "$"
