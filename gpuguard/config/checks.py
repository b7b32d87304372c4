"""Checks across keys: values each valid alone that are wrong together (a staleness bound the
poll would always pass, a fast interval above the poll, a namespace default above its maximum).

Owns these rules and their messages (``rules`` hands the messages to the Helm chart's checkers).
Must not parse values: a key that failed its own check is skipped here, as a rule about it would
only repeat the problem.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final

from gpuguard.config.settings import Key, NamespaceSettings, Settings

DEFAULT_ABOVE_MAX = (
    "{table}.default is above {table}.max: the default would always be capped; lower the "
    "default or raise the maximum"
)
STALENESS_BOUNDS: Final = (
    ("enforcement", "poll_interval_seconds", 2, "twice enforcement.poll_interval_seconds",
     "every sample would be stale"),
    ("nvml", "call_timeout_seconds", 1, "nvml.call_timeout_seconds",
     "a slow NVML call would make every sample stale"),
    ("kube", "watch_timeout_seconds", 1, "kube.watch_timeout_seconds",
     "a quiet node's pod cache would look stale"),
)  # fmt: skip
"""``enforcement.staleness_seconds`` must exceed ``factor`` × each ``section.key``: what, why."""
STALE = "must be more than {what} ({bound}, from {source}), else {why}"
FAST_ABOVE_POLL = (
    "must not exceed enforcement.poll_interval_seconds ({poll}, from {source}): every device is "
    "listed each poll interval anyway (0 turns the fast path off)"
)

_STALENESS: Final = ("enforcement", "staleness_seconds")
_FAST: Final = ("enforcement", "fast_interval_seconds")
_POLL: Final = ("enforcement", "poll_interval_seconds")


def default_above_max(namespace: NamespaceSettings) -> bool:
    """A namespace's default limit the maximum would always cap (both quantities, or both
    percentages; a quantity and a percentage compare only on a device)."""
    default, maximum = namespace.default, namespace.max
    if default is None or maximum is None:
        return False
    if default.limit_bytes is not None and maximum.limit_bytes is not None:
        return default.limit_bytes > maximum.limit_bytes
    if default.percent is not None and maximum.percent is not None:
        return default.percent > maximum.percent
    return False


def cross_key_problems(
    settings: Settings,
    *,
    origins: Mapping[Key, str],
    failed: Collection[Key],
    uses_api_server: bool,
) -> list[str]:
    """The problems of ``settings`` across keys, each naming where its values came from
    (``origins``; a key absent there is a default). Keys in ``failed`` are not checked again.
    Without the API server (a pods file) there is no watch, so its timeout bounds nothing."""
    problems = _fast_interval_problems(settings, origins=origins, failed=failed)
    staleness = settings.enforcement.staleness_seconds
    for section, key, factor, what, why in STALENESS_BOUNDS:
        if section == "kube" and not uses_api_server:
            continue
        if _STALENESS in failed or (section, key) in failed:
            continue
        bound = factor * getattr(getattr(settings, section), key)
        if staleness <= bound:
            origin = origins.get(_STALENESS, "defaults")
            other = origins.get((section, key), "default")
            problems.append(
                f"{origin}: enforcement.staleness_seconds = {staleness:g}: "
                + STALE.format(what=what, bound=f"{bound:g}", source=other, why=why)
            )
    return problems


def _fast_interval_problems(
    settings: Settings, *, origins: Mapping[Key, str], failed: Collection[Key]
) -> list[str]:
    fast = settings.enforcement.fast_interval_seconds
    poll = settings.enforcement.poll_interval_seconds
    if _FAST in failed or _POLL in failed or fast <= poll:
        return []
    origin = origins.get(_FAST, "defaults")
    other = origins.get(_POLL, "default")
    return [
        f"{origin}: enforcement.fast_interval_seconds = {fast:g}: "
        + FAST_ABOVE_POLL.format(poll=f"{poll:g}", source=other)
    ]
