"""Kernel facts about process IDs that every layer may need, the CLI's parser included (it must
stay cheap to import: standard library only, nothing that loads structlog or rich)."""

from __future__ import annotations

PID_MAX_LIMIT = 4_194_304
"""The largest PID Linux can hand out (``PID_MAX_LIMIT``, ``include/linux/threads.h``: 2**22 on
64-bit; ``/proc/sys/kernel/pid_max`` is at most this). A larger number is never a process."""
