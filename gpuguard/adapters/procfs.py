"""procfs: reads ``<proc_root>/<pid>/stat`` and ``<proc_root>/<pid>/cgroup``; nothing else.

Owns host PID → identity and cgroup lines. Must never open ``root``, ``cwd``, ``environ`` or
anything inside a container's filesystem, and never signal anything.
"""

from __future__ import annotations

from pathlib import Path

from gpuguard.core.model import ProcessIdentity


def read_start_ticks(proc_root: Path, pid: int) -> int | None:
    """``starttime`` (field 22) of ``<proc_root>/<pid>/stat``; ``None`` if the PID is gone.

    ``comm`` (field 2) may contain spaces and ``)``, so split after the *last* ``)``
    (proc(5)).
    """
    try:
        raw = (proc_root / str(pid) / "stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    end = raw.rfind(b")")
    if end < 0:
        return None
    fields = raw[end + 2 :].split()
    # After ")": field 3 (state) is fields[0], so field 22 (starttime) is fields[19].
    if len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def read_identity(proc_root: Path, pid: int) -> ProcessIdentity | None:
    """The process's ``(pid, starttime)``, or ``None`` if it is not in ``/proc``."""
    start = read_start_ticks(proc_root, pid)
    return None if start is None else ProcessIdentity(pid=pid, start_ticks=start)


def read_cgroup_text(proc_root: Path, pid: int) -> str | None:
    """The text of ``<proc_root>/<pid>/cgroup``, or ``None`` if the PID is gone."""
    try:
        return (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
