"""The images a real-node test imports into containerd: the gpuguard image ``make image`` builds
from the repo's Dockerfile (scripts/build-image.sh) on a chosen base, the Debian python3 base of
scripts/ensure-python-base.sh (``make python-base``), which is also the tenants' image. The
build is BuildKit's; a warm run costs the Dockerfile's steps, the export and the checks. One
build serves a test session: the first that succeeds is kept (tests/test_image_layout.py checks
the same build)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rigs.controlplane import script_output

BUILD_COMMAND = "scripts/build-image.sh"
BASE_COMMAND = "scripts/ensure-python-base.sh"


@dataclass(frozen=True)
class Built:
    gpuguard_archive: Path
    gpuguard_ref: str
    base_archive: Path
    base_ref: str


_SESSION: list[Built] = []
"""The first successful build of this process: the image is the same whichever runc built it."""


def build(node_bin: Path | None = None, timeout: float = 1800.0) -> tuple[Built | None, str | None]:
    """The base from ``scripts/ensure-python-base.sh``, then ``BASE_ARCHIVE=<it>
    scripts/build-image.sh`` (``make image``); ``(Built, None)`` or ``(None, why)``.

    The build's last stdout line is ``<archive> <image name>``. ``node_bin`` is the node
    binaries' directory (its runc runs BuildKit's builds)."""
    if _SESSION:
        return _SESSION[0], None
    base, why = python_base(timeout)
    if base is None:
        return None, why
    base_archive, base_ref = base
    env = dict(os.environ, BASE_ARCHIVE=str(base_archive))
    env.pop("BASE_IMAGE", None)
    if node_bin is not None:
        env["NODE_BIN"] = str(node_bin)
    lines, why = script_output(BUILD_COMMAND, env=env, timeout=timeout)
    if lines is None:
        return None, why
    image, image_ref = lines[-1].split(" ", 1)
    _SESSION.append(Built(Path(image), image_ref, base_archive, base_ref))
    return _SESSION[0], None


def python_base(timeout: float = 1800.0) -> tuple[tuple[Path, str] | None, str | None]:
    """``((archive, image name), None)`` of the Debian python3 base
    (``scripts/ensure-python-base.sh``, cached), or ``(None, why)``."""
    lines, why = script_output(BASE_COMMAND, prefix="PYTHON_BASE=", timeout=timeout)
    if lines is None:
        return None, why
    base_dir = Path(lines[-1].removeprefix("PYTHON_BASE="))
    return (base_dir / "python-base.oci.tar", (base_dir / "name").read_text().strip()), None
