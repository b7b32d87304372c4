"""The Dockerfile (linted by hadolint in ``make lint``; ``make image`` builds it with BuildKit) and
its inputs stay in step with the project: the entry point is the project's console script, the
image installs this package and exactly its locked dependencies, the labels carry its version, the
build context holds what the build copies, and the build stage compiles the fast path's quiet gate
(setup.py's optional C extension) and fails without it while the final stage carries no compiler.
"""

from __future__ import annotations

import email.parser
import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import gpuguard
from rigs.prereq import require

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
IMAGE_ENVIRONMENT: dict[str, str] = {
    **{k: str(v) for k, v in default_environment().items()},
    "python_version": "3.11",
    "python_full_version": "3.11.11",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    """The instructions split into stages, each starting at its ``FROM`` (the ``ARG`` before the
    first ``FROM`` left out)."""
    out: list[list[tuple[str, str]]] = []
    for keyword, args in instructions():
        if keyword == "FROM":
            out.append([])
        if out:
            out[-1].append((keyword, " ".join(args.split())))
    return out


GATE_MODULE = "gpuguard.adapters.nvml._gate"


def gate_check_program() -> str:
    """The Python program the build stage's last RUN runs against /install."""
    build, _ = stages()
    last_run = [a for k, a in build if k == "RUN"][-1]
    match = re.search(r"python3 -P -c '([^']*)'$", last_run)
    assert match, f"the build stage's last RUN does not end in the gate check: {last_run}"
    return match.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install .`` in the image, built here the same way (once for this module)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("gpuguard-*.whl")
    return built


def locked() -> dict[str, tuple[Version, int]]:
    """requirements.lock: name → (version, number of hashes)."""
    pins: dict[str, tuple[Version, int]] = {}
    name = ""
    for raw in (REPO / "requirements.lock").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("--hash=sha256:"):
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
            continue
        pin = line.removesuffix("\\").strip()
        requirement = Requirement(pin)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"not an exact pin: {pin}"
        name = canonicalize_name(requirement.name)
        pins[name] = (Version(spec.version), 0)
    return pins


def test_the_entry_point_is_the_projects_console_script() -> None:
    entry = [args for keyword, args in instructions() if keyword == "ENTRYPOINT"]
    assert entry == ['["gpuguard"]']
    assert list(PYPROJECT["project"]["scripts"]) == ["gpuguard"]


def test_both_stages_use_one_pinned_base_image_and_the_labels_carry_the_version() -> None:
    steps = instructions()
    (arg,) = [a for k, a in steps if k == "ARG"]
    name, _, image = arg.partition("=")
    assert name == "PYTHON_IMAGE"
    tag = image.split(":", 1)[1]
    assert tag.split("-")[0].count(".") == 2, f"not pinned to a patch release: {image}"
    assert tag.startswith(PYPROJECT["tool"]["mypy"]["python_version"] + ".")
    assert [a for k, a in steps if k == "FROM"] == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    labels = " ".join(a for k, a in steps if k == "LABEL")
    assert f'org.opencontainers.image.version="{gpuguard.__version__}"' in labels
    assert PYPROJECT["project"]["version"] == gpuguard.__version__
    assert f'org.opencontainers.image.licenses="{PYPROJECT["project"]["license"]}"' in labels


def test_the_image_installs_the_lock_with_hashes_then_this_package_without_dependencies() -> None:
    build, _ = stages()
    pips = [a for k, a in build if k == "RUN" and a.startswith("pip ")]
    assert len(pips) == 2
    assert pips[0] == (
        "pip install --no-cache-dir --require-hashes --prefix=/install -r requirements.lock"
    )
    assert pips[1].startswith("pip install --no-cache-dir --no-deps --prefix=/install . && ")


def test_the_build_stage_installs_a_compiler_copies_setup_py_and_checks_the_gate() -> None:
    build, _ = stages()
    (apt,) = [a for k, a in build if k == "RUN" and "apt-get" in a]
    installed = apt.split("apt-get install", 1)[1].split("&&", 1)[0].split()
    assert "--no-install-recommends" in installed
    assert {"gcc", "libc6-dev"} <= set(installed), installed
    assert "apt-get update" in apt
    assert apt.endswith("&& rm -rf /var/lib/apt/lists/*"), "apt lists left in the layer"
    # Python's headers only where the base lacks them (the Debian python3 base of make python-base).
    assert "Python.h" in apt
    assert "libpython%d.%d-dev" in apt
    copied = " ".join(a for k, a in build if k == "COPY")
    assert "setup.py" in copied.split(), "setup.py (the gate's build) not in the build stage"
    assert f'"{GATE_MODULE}"' in (REPO / "setup.py").read_text()
    assert GATE_MODULE in gate_check_program()


def test_the_final_stage_only_copies_the_install_and_carries_no_compiler() -> None:
    """Besides the install, only the allocation guard loader's runtime library (libbpf1, which
    brings libelf1): no compiler, no apt lists left in the layer."""
    _, final = stages()
    assert [k for k, _ in final] == ["FROM", "LABEL", "RUN", "COPY", "ENTRYPOINT", "CMD"]
    assert ("COPY", "--from=build /install /usr/local") in final
    (run,) = [a for k, a in final if k == "RUN"]
    installed = run.split("apt-get install", 1)[1].split("&&", 1)[0].split()
    assert [p for p in installed if not p.startswith("-")] == ["libbpf1"]
    assert "--no-install-recommends" in installed
    assert run.endswith("&& apt-get clean && rm -rf /var/lib/apt/lists/*"), "apt caches left"
    assert not any(re.search(r"\b(gcc|cc|clang[-\w]*|llvm[-\w]*)\b", a) for _, a in final)


def guard_check_program() -> str:
    """The Python program the build stage runs against /install for the allocation guard."""
    build, _ = stages()
    last_run = [a for k, a in build if k == "RUN"][-1]
    match = re.search(r"python3 -P -c '([^']*allocguard[^']*)'", last_run)
    assert match, f"the build stage's last RUN does not check the allocation guard: {last_run}"
    return match.group(1)


def test_the_build_stage_builds_the_allocation_guard_with_the_bpf_tools_and_checks_it() -> None:
    """scripts/ensure-bpf.sh's tools in the build stage only, named by BPF_TOOLS for setup.py,
    whose loader and object the check after ``pip install .`` requires."""
    build, final = stages()
    copied = [a for k, a in build if k == "COPY"]
    assert "scripts/ensure-bpf.sh scripts/ensure-lib.sh ./scripts/" in copied
    runs = [a for k, a in build if k == "RUN"]
    (ensure,) = [a for a in runs if "ensure-bpf.sh" in a]
    assert ensure.startswith("BPF_CACHE=/opt/bpf bash scripts/ensure-bpf.sh")
    # ensure-bpf.sh links /opt/bpf/current to the versions' directory it prepared.
    assert ("ENV", "BPF_TOOLS=/opt/bpf/current") in build
    assert runs.index(ensure) < len(runs) - 1, "the tools come after the package's build"
    assert "BPF_TOOLS" not in " ".join(a for _, a in final)
    # What the unpacked clang, bpftool and libbpf load from the system (the slim base lacks
    # them; seen failing there with "libedit.so.2: cannot open shared object file").
    (apt,) = [a for a in runs if "apt-get" in a]
    installed = set(apt.split("apt-get install", 1)[1].split("&&", 1)[0].split())
    assert {
        "libedit2",
        "libelf1",
        "libffi8",
        "libxml2",
        "libz3-4",
        "zlib1g",
        "libcap2",
    } <= installed
    assert runs.index(apt) < runs.index(ensure)
    program = guard_check_program()
    assert "loader_built()" in program
    assert "GUARD_OBJECT.is_file()" in program


def test_the_build_stages_gate_check_passes_with_the_gate_and_fails_without_it(
    wheel: Path, tmp_path: Path
) -> None:
    """The check the build stage runs, against this wheel installed the image's way (``--prefix``)
    in place of /install; then with the gate's file removed, as a machine without a compiler
    installs it."""
    require(shutil.which("gcc") is not None, "gcc missing: the wheel is built without the gate")
    prefix = tmp_path / "install"
    # --ignore-installed: a --prefix install must never touch the venv's own (editable) gpuguard.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--ignore-installed",
            "-q",
            f"--prefix={prefix}",
            wheel,
        ],
        check=True,
        timeout=120,
    )
    program = gate_check_program().replace('"/install"', repr(str(prefix)))

    def check() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-P", "-c", program],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    passed = check()  # the wheel built here with gcc has the gate, as the image's build stage
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.startswith(f"quiet gate built: {prefix}/"), passed.stdout
    (built,) = prefix.glob("lib/python3*/site-packages/gpuguard/adapters/nvml/_gate*.so")
    built.unlink()
    failed = check()
    assert failed.returncode == 1
    assert "the quiet gate was not built" in failed.stderr


def test_the_lock_pins_every_dependency_within_the_projects_ranges_with_hashes() -> None:
    pins = locked()
    assert all(hashes > 0 for _, hashes in pins.values())
    for text in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is a dependency but not locked: regenerate requirements.lock"
        version, _ = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"locked {name}=={version} is outside pyproject's {requirement.specifier}: "
            "regenerate requirements.lock"
        )


def test_the_lock_is_closed_under_the_dependencies_of_what_it_pins() -> None:
    """Every requirement of a locked package (for the image's Linux/CPython 3.11) is locked too,
    read from the installed distributions' metadata where the installed version is the locked
    one; ``--require-hashes`` would fail the image build on a missing one."""
    from importlib import metadata

    pins = locked()
    checked = 0
    for name, (version, _) in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version) != version:
            continue
        checked += 1
        for text in dist.requires or ():
            requirement = Requirement(text)
            env: dict[str, str] = {**IMAGE_ENVIRONMENT, "extra": ""}
            if requirement.marker is not None and not requirement.marker.evaluate(env):
                continue
            dep = canonicalize_name(requirement.name)
            assert dep in pins, f"{name} needs {dep}, which requirements.lock does not pin"
    assert checked >= len(PYPROJECT["project"]["dependencies"])


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_else_of_note() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def included(path: str) -> bool:
        keep = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern[1:] if negate else pattern
            body = body.rstrip("/")
            if fnmatch.fnmatch(path, body) or path.startswith(body + "/"):
                keep = negate
        return keep

    sources = [a.split()[0] for k, a in instructions() if k == "COPY" and "--from" not in a]
    for source in sources:
        assert included(source), f"COPY {source}: excluded by .dockerignore"
    for source in ("pyproject.toml", "setup.py", "README.md", "requirements.lock"):
        assert any(source in a for k, a in instructions() if k == "COPY")
    for private in (".venv/bin/python", "tests/test_cli.py", ".git/HEAD", "testbin/bin", ".whl"):
        assert not included(private), f"{private} would be sent to the Docker daemon"
    assert included("gpuguard/cli.py")


def test_the_wheel_the_image_installs_has_the_package_and_the_entry_point(wheel: Path) -> None:
    """What ``pip install .`` in the image installs: built here the same way."""
    assert wheel.name.startswith(f"gpuguard-{gpuguard.__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        text = z.read(entry_points).decode()
        meta = email.parser.Parser().parsestr(
            z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )
    assert "gpuguard = gpuguard.cli:main" in text
    assert "gpuguard/cli.py" in names
    assert "gpuguard/adapters/kube/agent.py" in names
    assert not any(n.startswith("tests/") for n in names)
    required = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    # What the image installs: the wheel's requirements without an optional extra (``bench``).
    declared = {
        canonicalize_name(r.name) for r in required if not r.marker or "extra" not in str(r.marker)
    }
    assert declared == {
        canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["dependencies"]
    }
