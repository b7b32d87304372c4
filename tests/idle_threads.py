"""How often a thread runs: its timeslices from ``/proc/self/task/<tid>/schedstat`` (Linux).

For tests that a thread sleeps while nothing happens (an idle enforcer wakes as rarely as it
can). Counts the thread's real scheduling by the kernel, so a periodic poll cannot hide.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def timeslices(native_id: int) -> int:
    """How many times the kernel has run thread ``native_id`` of this process so far."""
    fields = Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()
    return int(fields[2])


def wakeups_while_idle(thread: threading.Thread, seconds: float) -> int:
    """How many times ``thread`` ran over the next ``seconds`` (the caller does nothing to it
    meanwhile)."""
    native_id = thread.native_id
    assert native_id is not None, f"{thread.name} has not started"
    before = timeslices(native_id)
    time.sleep(seconds)
    return timeslices(native_id) - before
