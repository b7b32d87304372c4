"""The docs say what the code does: docs/install.md's limit snippet computes what gpuguard
computes, and every reference to the design document points at a section it has."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.kube.quantity import InvalidQuantity, parse_limit

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "docs" / "install.md"
DESIGN = ROOT / "docs" / "design.md"
GI = 1 << 30
TOTAL = 80 * GI
"""The device the snippet and gpuguard resolve limits on (an H100's 80 GiB)."""


class FakeTorch(types.ModuleType):
    """The two torch calls the snippet makes: the device's total memory, and the cap it sets."""

    def __init__(self, total_memory: int) -> None:
        super().__init__("torch")
        self.fractions: list[tuple[float, int]] = []
        properties = types.SimpleNamespace(total_memory=total_memory)
        self.cuda = types.SimpleNamespace(
            get_device_properties=lambda index: properties,
            set_per_process_memory_fraction=self._set_fraction,
        )

    def _set_fraction(self, fraction: float, device: int) -> None:
        self.fractions.append((fraction, device))


def install_snippet() -> str:
    """The Python block of docs/install.md that defines ``limit_bytes``."""
    blocks = re.findall(r"```python\n(.*?)```", INSTALL.read_text(encoding="utf-8"), re.DOTALL)
    found = [block for block in blocks if "def limit_bytes" in block]
    assert len(found) == 1, "docs/install.md must have one Python block defining limit_bytes"
    return str(found[0])


def run_snippet(
    monkeypatch: pytest.MonkeyPatch, limit: str | None, total: int = TOTAL
) -> tuple[dict[str, Any], FakeTorch]:
    torch = FakeTorch(total)
    monkeypatch.setitem(sys.modules, "torch", torch)
    if limit is None:
        monkeypatch.delenv("GPU_MEMORY_LIMIT", raising=False)
    else:
        monkeypatch.setenv("GPU_MEMORY_LIMIT", limit)
    namespace: dict[str, Any] = {"__name__": "snippet"}
    exec(compile(install_snippet(), str(INSTALL), "exec"), namespace)
    return namespace, torch


def gpuguards_bytes(text: str, total: int = TOTAL) -> int | None:
    """What the enforcer holds a pod with this annotation to on a ``total``-byte device."""
    try:
        return parse_limit(text).resolve(total)
    except InvalidQuantity:
        return None


VALID = [
    # every suffix Kubernetes knows, binary and decimal
    "8Gi", "8192Mi", "8388608Ki", "1Ti", "1Pi", "1Ei", "0.5Ti",
    "8G", "8000M", "8000000k", "2T", "1P", "1E", "8000000000",
    "2000000000000m", "8000000000000000u", "8000000000000000000n",
    # decimal exponents, the case the old snippet raised on
    "8e9", "8E9", "8e+9", "1.5e9", "1.e9", ".5e10", "80e8", "8000000000e-1", "1e19", "1e300",
    # fractions, a leading sign, fractional bytes (round up)
    "1.5Gi", ".5Gi", "5.Gi", "+8Gi", "8.000001Gi", "1.0000001G", "1048576.5",
    # percentages of the device
    "25%", "12.5%", "100%", "0.5%", "+50%",
    # at the smallest limit gpuguard accepts
    "1Mi", "1048576", "1.048576M",
]  # fmt: skip

REJECTED = [
    # rejected by gpuguard and by the snippet: a limit nobody gets
    "8GB", "8 Gi", "8gi", "8ki", "", "0", "0Gi", "-1Gi", "-5%", "0%", "150%", "abc", "8Gi1",
    "1e3k", "16", "8k", "100m", "1Ki", "1" * 65,
    # "K" is not a Kubernetes suffix (the API server refuses "8K" as a quantity)
    "8000K", "2000000K",
]  # fmt: skip


@pytest.mark.parametrize("text", VALID)
def test_the_install_snippet_computes_the_bytes_gpuguard_enforces(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    namespace, _ = run_snippet(monkeypatch, None)
    limit_bytes: Callable[[str, int], int | None] = namespace["limit_bytes"]
    expected = gpuguards_bytes(text)
    assert expected is not None, f"{text!r} is meant to be valid"
    assert limit_bytes(text, TOTAL) == expected


@pytest.mark.parametrize("text", REJECTED)
def test_the_install_snippet_caps_nothing_for_a_value_kubernetes_or_gpuguard_rejects(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    namespace, _ = run_snippet(monkeypatch, None)
    assert namespace["limit_bytes"](text, TOTAL) is None
    if "K" not in text:  # gpuguard's parser takes "K" as "k" (left for its own issue)
        assert gpuguards_bytes(text) is None


def test_the_install_snippet_sets_pytorchs_cap_below_the_limit_and_never_above_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, torch = run_snippet(monkeypatch, "8e9")
    [(fraction, device)] = torch.fractions
    assert fraction == pytest.approx((8e9 - GI) / TOTAL)
    assert device == 0
    _, torch = run_snippet(monkeypatch, "1Ei")
    assert torch.fractions == [(1.0, 0)]
    _, torch = run_snippet(monkeypatch, "8K")
    assert torch.fractions == []
    _, torch = run_snippet(monkeypatch, None)
    assert torch.fractions == []


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation dropped,
    spaces as hyphens."""
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


USER_FACING = [
    ROOT / "README.md",
    ROOT / "config.example.toml",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "helm" / "gpuguard" / "values.yaml",
    ROOT / "helm" / "gpuguard" / "values.schema.json",
]
"""What users read. The CLI's help is checked in tests/test_cli.py; code comments and docstrings
are not user-facing."""


def test_every_reference_to_the_design_document_names_a_section_it_has() -> None:
    sections = anchors(DESIGN.read_text(encoding="utf-8"))
    seen = 0
    for path in [*USER_FACING, ROOT / "gpuguard" / "cli.py"]:
        for anchor in re.findall(r"design\.md#([\w-]+)", path.read_text(encoding="utf-8")):
            seen += 1
            assert anchor in sections, f"{path.relative_to(ROOT)}: design.md#{anchor}"
    assert seen >= 20


def test_no_user_facing_text_cites_a_design_section_readers_cannot_open() -> None:
    for path in USER_FACING:
        text = path.read_text(encoding="utf-8")
        assert "DESIGN §" not in text, path.relative_to(ROOT)
