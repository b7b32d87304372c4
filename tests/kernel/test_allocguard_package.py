"""The allocation guard as the image carries it: the wheel ``pip install .`` builds in the
Dockerfile's build stage (setup.py with ``BPF_TOOLS``), installed the image's way
(``--prefix``), passes the build stage's own check and loads on this kernel from the installed
copy alone (the object at ``GUARD_OBJECT``, the loader, the thawer); a wheel built without the
tools fails that check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rigs.allocguard import AllocGuardBuild, bpf_tools, build
from rigs.prereq import require

pytestmark = pytest.mark.kernel

REPO = Path(__file__).resolve().parents[2]

LOAD = """
import sys
from pathlib import Path
import gpuguard.adapters.allocguard as allocguard
from gpuguard.adapters.allocguard import GUARD_OBJECT, AllocGuard
assert Path(allocguard.__file__).is_relative_to(sys.argv[1]), allocguard.__file__
guard = AllocGuard(object_path=GUARD_OBJECT, library_path=Path(sys.argv[2]))
print("loaded", GUARD_OBJECT, guard.thawer_pid, sorted(guard.map_ids()), flush=True)
guard.close()
"""


def build_stage_check() -> str:
    """The allocation guard check the Dockerfile's build stage runs after ``pip install .``."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (program,) = re.findall(r"python3 -P -c '([^']*allocguard[^']*)'", text)
    return str(program)


def source_copy(tmp: Path) -> Path:
    """What the Dockerfile copies before ``pip install .``, from git's list of the checkout's
    files: never what a test built in place (the loader, ``guard.bpf.o``: ignored files)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", *IMAGE_SOURCES],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    src = tmp / "src"
    for name in listed:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    return src


IMAGE_SOURCES = ("pyproject.toml", "setup.py", "README.md", "gpuguard")


def install(tmp: Path, *, tools: Path | None) -> Path:
    """The wheel built as in the image (with ``BPF_TOOLS`` or not), installed under a prefix."""
    env = {k: v for k, v in os.environ.items() if k != "BPF_TOOLS"}
    if tools is not None:
        env["BPF_TOOLS"] = str(tools)
    wheels, prefix = tmp / "wheel", tmp / "install"
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-q", "-w", str(wheels), str(source_copy(tmp))],
        env=env,
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("gpuguard-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--ignore-installed", "-q", f"--prefix={prefix}", wheel],
        check=True,
        timeout=120,
    )
    return prefix


def run_check(prefix: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    program = build_stage_check().replace('"/install"', repr(str(prefix)))
    return subprocess.run(
        [sys.executable, "-P", "-c", program],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def built() -> AllocGuardBuild:
    require(os.geteuid() == 0, "needs root (bpf, uprobes)")
    return build()  # the libcuda stand-in, and the tools fetched


def test_the_wheel_built_with_the_bpf_tools_carries_a_guard_that_loads_from_the_install(
    built: AllocGuardBuild, tmp_path: Path
) -> None:
    tools = bpf_tools()
    assert tools is not None
    prefix = install(tmp_path, tools=tools)
    checked = run_check(prefix, tmp_path)
    assert checked.returncode == 0, checked.stderr
    (site,) = prefix.glob("lib/python3*/site-packages")
    package = site / "gpuguard" / "adapters" / "allocguard"
    assert checked.stdout.strip() == f"allocation guard built: {package / 'guard.bpf.o'}"
    assert list(package.glob("_loader*.so")), "no loader in the install"
    # Loaded from the installed copy alone: -P and a cwd outside the repository, its
    # site-packages the only gpuguard on the path (the thawer runs from it too).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    loaded = subprocess.run(
        [sys.executable, "-P", "-c", LOAD, str(site), str(built.stub_library)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith(f"loaded {package / 'guard.bpf.o'} "), loaded.stdout
    assert "'frozen'" in loaded.stdout, loaded.stdout


def test_a_wheel_built_without_the_bpf_tools_fails_the_build_stages_check(
    built: AllocGuardBuild, tmp_path: Path
) -> None:
    prefix = install(tmp_path, tools=None)
    checked = run_check(prefix, tmp_path)
    assert checked.returncode == 1, checked.stdout
    assert "the allocation guard loader was not built" in checked.stderr
