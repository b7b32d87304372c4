"""Loading: defaults < file < environment < command line → one ``Settings``, or one
``ConfigError`` with every problem found.

Owns the order of the sources and the last checks across keys. Must not act on the settings
(no NVML, no API server, no logging setup): ``app.py`` wires them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuguard.config.checks import cross_key_problems
from gpuguard.config.collected import Collected
from gpuguard.config.file import read_file
from gpuguard.config.overlay import CONFIG_PATH_ENV, read_env, read_overrides
from gpuguard.config.settings import SECTIONS, Settings
from gpuguard.errors import ConfigError


def load_settings(
    *,
    config_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
    uses_api_server: bool = True,
) -> Settings:
    """Settings from defaults < file < environment < overrides; raises one ``ConfigError``.

    ``config_path`` ``None``: ``$GPUGUARD_CONFIG`` if set, else no file. ``environ`` ``None``:
    the process environment (pass ``{}`` to ignore it). ``overrides``: dotted keys from flags.
    ``uses_api_server`` false (``--pods-file``): checks that only concern the API server's
    watches are skipped, and ``node.pod_resources_socket`` is off unless set (a pods file
    stands in for a cluster, so there is no kubelet to ask by default).
    """
    env = os.environ if environ is None else environ
    collected = Collected()
    path = config_path if config_path is not None else env.get(CONFIG_PATH_ENV) or None
    if path is not None:
        read_file(collected, Path(path))
    read_env(collected, env)
    read_overrides(collected, overrides or {})
    return _build(collected, uses_api_server=uses_api_server)


def _build(collected: Collected, *, uses_api_server: bool) -> Settings:
    groups: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        kwargs = {k: v for (s, k), v in collected.values.items() if s == section}
        if section == "limits":
            kwargs["namespaces"] = dict(collected.namespaces)
        if section == "node" and not uses_api_server and "pod_resources_socket" not in kwargs:
            # A pods file stands in for a cluster: no kubelet either, unless one is named.
            kwargs["pod_resources_socket"] = None
        groups[section] = cls(**kwargs)
    settings = Settings(**groups)
    problems = collected.problems + cross_key_problems(
        settings,
        origins=collected.origins,
        failed=collected.failed_keys(),
        uses_api_server=uses_api_server,
    )
    if problems:
        raise ConfigError(problems)
    return settings
