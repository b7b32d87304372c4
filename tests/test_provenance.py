"""The provenance header every raw output starts with names the commit, whether its tree was
dirty, the machine, the GPU driver, the command and the time."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from rigs.prereq import require
from rigs.provenance import header, header_lines

FIELDS = ["commit", "dirty", "machine", "gpu driver", "command", "utc"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout of one commit, read as the header reads a checkout (no commit variable)."""
    require(shutil.which("git") is not None, "needs git")
    for name in ("GPUGUARD_COMMIT", "GPU_E2E_COMMIT"):
        monkeypatch.delenv(name, raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("a\n", encoding="utf-8")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "a")
    return tmp_path


def fields(lines: list[str]) -> dict[str, str]:
    assert all(line.startswith("# ") for line in lines)
    return dict(line.removeprefix("# ").split(": ", 1) for line in lines)


def test_the_header_names_each_fact_and_a_clean_tree_is_not_dirty(repo: Path) -> None:
    found = fields(header_lines(repo=repo))
    assert list(found) == FIELDS
    assert found["commit"] == git(repo, "rev-parse", "HEAD")
    assert found["dirty"] == "no"
    assert "logical CPUs" in found["machine"]
    assert "GiB memory" in found["machine"]
    assert "kernel " in found["machine"]
    assert found["gpu driver"].startswith(("none", "unknown")) or "×" in found["gpu driver"]
    assert "pytest" in found["command"]
    assert found["utc"].endswith(" UTC")


def test_a_changed_or_untracked_file_makes_the_tree_dirty(repo: Path) -> None:
    (repo / "a.txt").write_text("b\n", encoding="utf-8")
    assert fields(header_lines(repo=repo))["dirty"] == "yes"
    git(repo, "checkout", "-q", "a.txt")
    (repo / "new.py").write_text("", encoding="utf-8")
    assert fields(header_lines(repo=repo))["dirty"] == "yes"


def test_a_tree_without_git_takes_the_commit_its_maker_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUGUARD_COMMIT", raising=False)
    monkeypatch.setenv("GPU_E2E_COMMIT", "2689101")
    found = fields(header_lines(repo=tmp_path))
    assert found["commit"] == "2689101"
    assert found["dirty"].startswith("unknown")
    monkeypatch.delenv("GPU_E2E_COMMIT")
    assert fields(header_lines(repo=tmp_path))["commit"] == "unknown"


def test_a_copy_that_carries_another_commits_git_takes_the_commit_its_maker_names(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU machine's copy of the working tree held a .git a session older than the tree:
    # the header named that commit, dirty, above a run of another.
    monkeypatch.setenv("GPU_E2E_COMMIT", "a479b7c")
    found = fields(header_lines(repo=repo))
    assert found["commit"] == "a479b7c"
    assert found["dirty"].startswith("unknown")


def test_the_machine_line_leaves_the_host_name_out() -> None:
    name = socket.gethostname()
    assert list(header()) == FIELDS
    assert all(name not in value for value in header().values() if len(name) > 3)
