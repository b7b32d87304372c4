"""The images a real-node test imports into containerd: the gpuguard image ``make image`` builds
from the repo's Dockerfile (scripts/build-image.sh), and its Debian python3 base, the tenants'
image. The build is BuildKit's, cached by layer; a warm run costs the export and the check."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rigs.controlplane import script_output

BUILD_COMMAND = "scripts/build-image.sh"


@dataclass(frozen=True)
class Built:
    gpuguard_archive: Path
    gpuguard_ref: str
    base_archive: Path
    base_ref: str


def build(node_bin: Path | None = None, timeout: float = 1800.0) -> tuple[Built | None, str | None]:
    """Run ``scripts/build-image.sh`` (``make image``); ``(Built, None)`` or ``(None, why)``.

    Its last two stdout lines are ``<archive> <image name>``, the gpuguard image's, then the
    base's. ``node_bin`` is the node binaries' directory (its runc runs BuildKit's builds)."""
    env = dict(os.environ)
    if node_bin is not None:
        env["NODE_BIN"] = str(node_bin)
    lines, why = script_output(BUILD_COMMAND, lines=2, env=env, timeout=timeout)
    if lines is None:
        return None, why
    (image, image_ref), (base, base_ref) = (line.split(" ", 1) for line in lines)
    return Built(Path(image), image_ref, Path(base), base_ref), None
