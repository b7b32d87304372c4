"""``readable``, the one way gpuguard waits on a descriptor: poll(2), so descriptors numbered
past FD_SETSIZE (the enforcer's, once it pins a thousand GPU processes) work as the first do."""

from __future__ import annotations

import contextlib
import os
import time

import pytest

from gpuguard.adapters.readiness import readable
from tests.descriptors import FD_SETSIZE, descriptors_past_fd_setsize


@pytest.mark.parametrize("past_fd_setsize", [False, True], ids=["low-fds", "fds-past-1024"])
def test_readable_names_the_readable_descriptors_and_waits_no_longer_than_asked(
    past_fd_setsize: bool,
) -> None:
    with descriptors_past_fd_setsize() if past_fd_setsize else contextlib.nullcontext():
        quiet_read, quiet_write = os.pipe()
        ready_read, ready_write = os.pipe()
    try:
        assert (quiet_read > FD_SETSIZE) is past_fd_setsize
        os.write(ready_write, b"x")
        assert readable([quiet_read, ready_read], 5.0) == {ready_read}
        start = time.monotonic()
        assert readable([quiet_read], 0.05) == set()
        assert 0.04 <= time.monotonic() - start < 2.0
        assert readable([quiet_read], 0) == set()
        os.close(quiet_write)
        assert readable([quiet_read], 5.0) == {quiet_read}, "a hang-up counts as readable"
    finally:
        for fd in (quiet_read, ready_read, ready_write):
            os.close(fd)
