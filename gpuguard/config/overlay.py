"""The environment and the command line, laid over the file: ``GPUGUARD_<SECTION>_<KEY>``
variables, ``NODE_NAME`` for ``node.name``, then the dotted keys the CLI builds from its flags.

Owns the variables' names, which ones are ignored (empty ones, ``GPUGUARD_CONFIG``, the service
links the kubelet injects) and refusing unknown variables and keys with the name they most likely
meant. Strings are parsed as text (``"2.5"``, ``"true"``, ``"a,b"``). Must not read the file
(``file``); per-namespace tables are file-only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from gpuguard.config.collected import Collected
from gpuguard.config.messages import closest, unknown_name
from gpuguard.config.settings import settable_keys

ENV_PREFIX: Final = "GPUGUARD_"
CONFIG_PATH_ENV: Final = "GPUGUARD_CONFIG"
NODE_NAME_ENV: Final = "NODE_NAME"

_SERVICE_LINK = re.compile(
    r"GPUGUARD(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
    r"|PORT(_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)",
    re.ASCII,
)
"""Variables the kubelet injects for a Service named ``gpuguard…`` (enableServiceLinks)."""


def env_var(section: str, key: str) -> str:
    """The environment variable for ``section.key``: ``GPUGUARD_<SECTION>_<KEY>``."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def read_env(collected: Collected, environ: Mapping[str, str]) -> None:
    """Every ``GPUGUARD_*`` variable of ``environ`` that is set, then ``NODE_NAME`` when no
    variable set ``node.name``; an empty variable counts as unset (Helm renders absent values
    as "")."""
    known = {env_var(s, k): (s, k) for s, k in settable_keys()}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name == CONFIG_PATH_ENV:
            continue
        value = environ[name]
        if name in known:
            if value != "":
                section, key = known[name]
                collected.record(section, key, value, text=True, origin=f"env {name}")
        elif not _SERVICE_LINK.fullmatch(name):
            # Without the prefix every variable shares, "GPUGUARD_FOO" is close to nothing.
            close = closest(name.removeprefix(ENV_PREFIX), [k[len(ENV_PREFIX) :] for k in known])
            collected.problems.append(
                unknown_name(
                    f"env {name}: unknown setting",
                    None if close is None else ENV_PREFIX + close,
                    "GPUGUARD_<SECTION>_<KEY>, e.g. GPUGUARD_ENFORCEMENT_MODE; per-namespace "
                    "limits are file-only",
                )
            )
    if ("node", "name") not in collected.values and environ.get(NODE_NAME_ENV, "") != "":
        collected.record(
            "node",
            "name",
            environ[NODE_NAME_ENV],
            text=True,
            origin=f"env {NODE_NAME_ENV}",
        )


def read_overrides(collected: Collected, overrides: Mapping[str, object]) -> None:
    """The command line's dotted keys (``{"enforcement.mode": "enforce"}``)."""
    known = set(settable_keys())
    for dotted, raw in overrides.items():
        section, _, key = dotted.partition(".")
        if (section, key) not in known:
            collected.problems.append(
                unknown_name(
                    f"command line: unknown setting {dotted}",
                    closest(dotted, [f"{s}.{k}" for s, k in known]),
                    "section.key, e.g. enforcement.mode",
                )
            )
            continue
        collected.record(section, key, raw, text=isinstance(raw, str), origin="command line")
