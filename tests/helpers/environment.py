"""The environment a test gives a gpuguard it starts: this process's, less any ``GPUGUARD_*``
setting (a developer's own config would change what the command under test reads).

Owns that filter. Must not add settings: each test names its own.
"""

from __future__ import annotations

import os


def environ_without_gpuguard_settings() -> dict[str, str]:
    """A copy of ``os.environ`` without the variables that start with ``GPUGUARD_``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUGUARD_")}
