"""kubemodel.quantity: the annotation and config size grammar, as Kubernetes has it."""

from __future__ import annotations

import decimal
import math
import re
from collections.abc import Callable
from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuguard.core.limits import MIN_LIMIT_BYTES
from gpuguard.core.model import LIMIT_ANNOTATION, LimitValue
from gpuguard.core.units import format_bytes
from gpuguard.kubemodel.quantity import (
    MAX_BYTES,
    InvalidQuantity,
    checker_grammar,
    parse_limit,
    parse_limit_annotation,
    parse_quantity_bytes,
)

GI = 1 << 30


@pytest.mark.parametrize(
    ("text", "expected_bytes"),
    [
        ("8Gi", 8 * GI),
        ("8G", 8_000_000_000),
        ("8192Mi", 8 * GI),
        ("1.5Gi", 1_610_612_736),
        ("8e9", 8_000_000_000),
        ("8E9", 8_000_000_000),
        ("8000000000", 8_000_000_000),
        ("16Gi", 16 * GI),
        ("16G", 16_000_000_000),
        ("16384Mi", 16 * GI),
        ("16e9", 16_000_000_000),
        ("16", 16),  # a bare number is bytes, as for Kubernetes memory
        ("+8Gi", 8 * GI),
        ("8Ki", 8192),
        ("1Ti", 1 << 40),
        ("1Pi", 1 << 50),
        ("1Ei", 1 << 60),
        ("1k", 1000),
        ("1M", 1_000_000),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),  # a lone E is exa, not an exponent
        ("1.", 1),
        (".5Gi", GI // 2),
        ("00008Gi", 8 * GI),
    ],
)
def test_accepts_kubernetes_quantities_with_kubernetes_values(
    text: str, expected_bytes: int
) -> None:
    assert parse_quantity_bytes(text) == expected_bytes
    if expected_bytes >= MIN_LIMIT_BYTES:
        assert parse_limit(text) == LimitValue(limit_bytes=expected_bytes)
    else:
        with pytest.raises(InvalidQuantity, match="below the smallest limit of 1Mi"):
            parse_limit(text)


@pytest.mark.parametrize(
    ("text", "expected_bytes"),
    [("1.5", 2), ("1m", 1), ("1n", 1), ("1500m", 2), ("0.1Ki", 103), ("1e-3", 1)],
)
def test_rounds_fractional_bytes_up_like_quantity_value(text: str, expected_bytes: int) -> None:
    assert parse_quantity_bytes(text) == expected_bytes


@pytest.mark.parametrize(
    "text", ["99999999999999999999Gi", "1e309", "1e999999999", "9" * 64, "8Ei" + "", "16Ei"]
)
def test_saturates_huge_values_at_int64_without_overflow(text: str) -> None:
    value = parse_limit(text).limit_bytes
    assert value is not None
    assert 0 < value <= MAX_BYTES


def test_computes_values_below_the_cap_exactly() -> None:
    # Python's default 28-digit decimal precision would round this product.
    number = "1.2345678901234567890123456789012345678"
    expected = math.ceil(Fraction(number) * 2**60)
    assert parse_limit(f"{number}Ei").limit_bytes == expected


@pytest.mark.parametrize(
    ("text", "percent"), [("25%", 25.0), ("12.5%", 12.5), ("100%", 100.0), ("0.5%", 0.5)]
)
def test_accepts_percentages_of_the_device(text: str, percent: float) -> None:
    assert parse_limit(text) == LimitValue(percent=percent)


@pytest.mark.parametrize(
    ("text", "code", "says"),
    [
        ("0", "zero", "is zero"),
        ("0Mi", "zero", "is zero"),
        ("0.0", "zero", "is zero"),
        ("-0", "zero", "is zero"),
        ("-1Gi", "negative", "is negative"),
        ("-1", "negative", "is negative"),
        ("8GB", "unit", "did you mean 8Gi or 8G?"),
        ("16gb", "unit", "did you mean 16Gi or 16G?"),
        ("16GB", "unit", "unknown unit"),
        ("1ki", "unit", "unknown unit"),
        ("1Mb", "unit", "unknown unit"),
        ("1ke3", "unit", "unknown unit"),
        ("8 Gi", "whitespace", "contains whitespace"),
        (" 16Gi ", "whitespace", "contains whitespace"),
        ("16Gi\n", "whitespace", "contains whitespace"),
        ("\t8Gi", "whitespace", "contains whitespace"),
        ("", "empty", "is empty"),
        ("abc", "syntax", "not a number"),
        ("null", "syntax", "not a number"),
        ('{"limit":"8Gi"}', "syntax", "not a number"),
        ("NaN", "syntax", "not a number"),
        ("Infinity", "syntax", "not a number"),
        ("１６Gi", "syntax", "not a number"),  # fullwidth digits
        ("٨Gi", "syntax", "not a number"),  # Arabic-Indic digit
        ("1_000", "syntax", "not a number"),
        ("1.2.3", "syntax", "not a number"),
        (".", "syntax", "not a number"),
        ("Gi", "syntax", "not a number"),
        ("0x10", "syntax", "not a number"),
        ("101%", "percent_range", "out of range"),
        ("100.5%", "percent_range", "out of range"),
        ("0%", "zero", "out of range"),
        ("0.0%", "zero", "out of range"),
        ("-5%", "negative", "out of range"),
        ("5 %", "whitespace", "not a valid percentage"),
        ("%", "syntax", "not a valid percentage"),
        ("25%%", "syntax", "not a valid percentage"),
        ("１０%", "syntax", "not a valid percentage"),
        ("NaN%", "syntax", "not a valid percentage"),
    ],
)
def test_rejects_invalid_values_with_a_reason_that_names_value_and_allowed_forms(
    text: str, code: str, says: str
) -> None:
    with pytest.raises(InvalidQuantity) as caught:
        parse_limit(text)
    assert caught.value.code == code
    message = str(caught.value)
    assert says in message
    assert repr(text)[:20] in message
    assert "8Gi" in message or "25%" in message  # an example of what is allowed


def test_shortens_a_huge_rejected_value_in_its_reason() -> None:
    text = "x" * 256 * 1024
    with pytest.raises(ValueError, match=r"262144 characters") as caught:
        parse_limit(text)
    assert len(str(caught.value)) < 600


def test_config_sizes_refuse_percentages() -> None:
    with pytest.raises(InvalidQuantity, match="is a percentage, not allowed here") as caught:
        parse_quantity_bytes("25%")
    assert caught.value.code == "percent_not_allowed"


@pytest.mark.parametrize(
    ("value", "text"),
    [(8 * GI, "8Gi"), (1536 << 20, "1536Mi"), (1000, "1000 bytes"), (1 << 60, "1Ei"),
     (1024, "1Ki")],
)  # fmt: skip
def test_formats_bytes_in_the_largest_exact_binary_unit(value: int, text: str) -> None:
    assert format_bytes(value) == text
    assert parse_quantity_bytes(text.split(maxsplit=1)[0]) == value


@pytest.mark.parametrize(
    ("value", "text"), [(8815083110, "8815083110 bytes (8.21Gi)"), (1025, "1025 bytes (1Ki)")]
)
def test_an_inexact_size_is_exact_bytes_then_an_approximation(value: int, text: str) -> None:
    """The one formatter (``core.units``): its first word is always an exact quantity."""
    assert format_bytes(value) == text
    assert parse_quantity_bytes(text.split(maxsplit=1)[0]) == value


@given(st.text(max_size=40))
def test_never_raises_anything_but_a_reasoned_value_error(text: str) -> None:
    value: LimitValue | None = None
    reason = ""
    try:
        value = parse_limit(text)
    except InvalidQuantity as error:
        reason = str(error)
    if value is None:
        assert reason
    elif value.limit_bytes is not None:
        assert 0 < value.limit_bytes <= MAX_BYTES
    else:
        assert value.percent is not None
        assert 0 < value.percent <= 100


@given(st.text(alphabet="0123456789.eEinumkKMGTP+- %", max_size=12))
def test_accepts_only_what_the_api_server_grammar_accepts(text: str) -> None:
    grammar = re.fullmatch(r"[+-]?[0-9.]+([eEinumkKMGTP]*[-+]?[0-9]*)", text, re.ASCII)
    percent = re.fullmatch(r"[0-9]+(\.[0-9]+)?%", text, re.ASCII)
    try:
        parse_limit(text)
    except InvalidQuantity:
        return
    assert grammar is not None or percent is not None


@given(st.integers(min_value=1, max_value=2**40), st.sampled_from(["", "Ki", "Mi", "Gi", "k", "M"]))
def test_integer_quantities_scale_exactly(number: int, suffix: str) -> None:
    scale = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 1000, "M": 10**6}[suffix]
    expected = min(number * scale, MAX_BYTES)
    assert parse_quantity_bytes(f"{number}{suffix}") == expected
    if expected >= MIN_LIMIT_BYTES:
        assert parse_limit(f"{number}{suffix}").limit_bytes == expected


@given(st.text(min_size=1, max_size=20).filter(lambda t: any(c.isspace() for c in t)))
def test_rejects_every_value_containing_whitespace(text: str) -> None:
    with pytest.raises(InvalidQuantity):
        parse_limit(text)


# ---------------------------------------------------------------------------------------------
# Hostile values


@pytest.mark.parametrize("text", ["16", "1", "8Ki", "1023Ki", "1048575", "1M", "1.5"])
def test_a_limit_below_one_mebibyte_is_refused_never_applied(text: str) -> None:
    with pytest.raises(InvalidQuantity) as raised:
        parse_limit(text)
    assert raised.value.code == "too_small"
    assert "1Mi" in str(raised.value)


def test_one_mebibyte_is_the_smallest_limit() -> None:
    assert parse_limit("1Mi").limit_bytes == MIN_LIMIT_BYTES
    assert parse_limit("1048576").limit_bytes == MIN_LIMIT_BYTES


@pytest.mark.parametrize(
    "text",
    [
        "1" * 65,
        "1" * 64 + "x",
        "1" * (256 << 10) + "x",
        "8Gi" + " " * 62,
        "%" * 100,
        "9" * 65 + "%",
    ],
)
def test_a_value_longer_than_64_characters_is_invalid_before_any_pattern_runs(text: str) -> None:
    with pytest.raises(InvalidQuantity) as raised:
        parse_limit(text)
    assert raised.value.code == "too_long"
    assert len(str(raised.value)) < 400  # the 256 KiB value is shown shortened


def test_the_grammar_cannot_backtrack_even_without_the_length_bound() -> None:
    """The pattern itself is linear: 1 M characters fail at once (the original pattern took
    12 s for 48 k). Measured side by side in ``benchmarks/quantity_redos.py``."""
    from gpuguard.kubemodel.quantity import _QUANTITY

    assert _QUANTITY.fullmatch("1" * 1_000_000 + "x") is None
    assert _QUANTITY.fullmatch("1" * 100 + "e" + "1" * 100) is not None


@settings(max_examples=2000)
@given(st.text(alphabet="0123456789.eEinumkKMGTP+-x ", max_size=30))
def test_the_possessive_grammar_accepts_exactly_the_api_servers_language(text: str) -> None:
    from gpuguard.kubemodel.quantity import _QUANTITY

    api_server = re.compile(r"^[+-]?[0-9.]+([eEinumkKMGTP]*[-+]?[0-9]*)$")
    assert (_QUANTITY.fullmatch(text) is not None) == (
        api_server.match(text) is not None and not text.endswith("\n")
    )


def test_the_checkers_grammar_starts_from_the_api_servers_pattern() -> None:
    """The Helm chart checks quantities with these: the API server's pattern, as its
    OpenAPI has it, then what parse_quantity takes of it."""
    grammar = checker_grammar()
    assert grammar["api"] == "^[+-]?[0-9.]+(?:[eEinumkKMGTP]*[-+]?[0-9]*)$"
    assert grammar["percent"] == r"^([+-]?[0-9]+(?:\.[0-9]+)?)%$"
    assert grammar["byte_unit"] == r"^([0-9.]+)\s*([kKmMgGtTpPeE])[bB]$"


@settings(max_examples=3000)
@given(st.text(alphabet="0123456789.eEinumkKMGTP+-", max_size=12))
def test_the_checkers_form_accepts_exactly_what_parse_quantity_takes(text: str) -> None:
    grammar = checker_grammar()
    matched = all(re.fullmatch(str(grammar[p]), text) for p in ("api", "form"))
    try:
        parse_quantity_bytes(text)
        parsed = True
    except InvalidQuantity as error:  # zero and negative: the grammar took it, the amount not
        parsed = error.code == "zero" or (error.code == "negative" and matched)
    assert matched == parsed


def _outcome(parse: Callable[[str], decimal.Decimal], text: str) -> str:
    """What ``parse`` makes of ``text`` in the context ``quantity`` parses in: the value's exact
    text, or the type of what it raised."""
    with decimal.localcontext() as context:
        context.prec = 120
        context.Emax = decimal.MAX_EMAX
        context.Emin = decimal.MIN_EMIN
        try:
            return str(parse(text))
        except (ValueError, ArithmeticError) as error:
            return type(error).__name__


@settings(max_examples=3000)
@given(
    st.from_regex(r"[+-]?[0-9.]{1,8}[eEinumkKMGTP]{0,2}[-+]?[0-9]{0,12}", fullmatch=True)
    | st.text(max_size=16)
)
@example("1Ki")
@example("1ki")
@example("1ke3")
@example("1.2.3")
@example("1e")
@example("1E")
@example("1Ei")
@example("1e999999999Ei")
@example("1e-999999999n")
@example(".")
def test_the_quantity_parser_is_the_python_clients_step_for_step(text: str) -> None:
    """kubemodel imports no third-party library, so it carries its own copy of the Python
    client's ``parse_quantity``: on the API server's language and on any text, both give the
    same value or raise the same type."""
    from kubernetes.utils import quantity

    from gpuguard.kubemodel.quantity import _parse_quantity

    assert _outcome(_parse_quantity, text) == _outcome(quantity.parse_quantity, text)


def test_the_checkers_suffixes_scale_as_parse_quantity_does() -> None:
    grammar = checker_grammar()
    decimal_exponents = grammar["decimal_exponents"]
    binary_factors = grammar["binary_factors"]
    assert isinstance(decimal_exponents, dict)
    assert isinstance(binary_factors, dict)
    for suffix, exponent in decimal_exponents.items():
        shift = 9 if exponent < 0 else 0  # whole bytes: n is 10**-9
        assert parse_quantity_bytes(f"{10**shift}{suffix}") == 10 ** (shift + exponent), suffix
    for suffix, factor in binary_factors.items():
        assert parse_quantity_bytes(f"1{suffix}") == min(factor, MAX_BYTES), suffix


@pytest.mark.parametrize(
    ("value", "shown"),
    [(8, "8"), (1.5, "1.5"), (True, "True"), (None, "None"), (["8Gi"], "['8Gi']"), ({}, "{}")],
)
def test_a_limit_annotation_that_is_not_a_string_is_invalid(value: object, shown: str) -> None:
    limit, error = parse_limit_annotation({LIMIT_ANNOTATION: value})
    assert limit is None
    assert error is not None
    assert shown in error
    assert "quote it" in error


def test_a_huge_non_string_value_is_shown_shortened() -> None:
    _limit, error = parse_limit_annotation({LIMIT_ANNOTATION: [["x" * 10_000] * 1000] * 1000})
    assert error is not None
    assert len(error) < 300
