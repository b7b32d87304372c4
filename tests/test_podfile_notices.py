"""FilePodDirectory's watcher on inotify (an idle enforcer wakes as rarely as it can):
it sleeps while the pods file stays as it is, and still sees every way the file changes at once
(renamed into place, written in place, a ConfigMap-style link swap); where the file cannot be
watched (its directory gone) it looks every poll interval, as before, until it can be again.

Every directory here polls only once a minute, so only a notice can explain a prompt pickup.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from structlog.testing import capture_logs

from gpuguard.adapters.inotify import watch_points
from gpuguard.adapters.podfile import FilePodDirectory
from gpuguard.core.model import PodUid
from rigs.controlplane import wait_until
from tests.descriptors import descriptors_past_fd_setsize
from tests.fakes import FakeClock
from tests.idle_threads import wakeups_while_idle
from tests.podfiles import UID_A, UID_B, pod, pods_list, write

PROMPTLY = 2.0
"""Seconds a change may take to be read (a notice takes milliseconds; a poll here, a minute)."""


@contextmanager
def watching(
    path: Path, clock: FakeClock, *, poll_seconds: float = 60.0
) -> Iterator[FilePodDirectory]:
    directory = FilePodDirectory(path, node_name="node-1", clock=clock, poll_seconds=poll_seconds)
    directory.start()
    try:
        yield directory
    finally:
        directory.stop()


def _uids(directory: FilePodDirectory) -> set[PodUid]:
    return set(directory.snapshot().pods)


def test_an_unchanged_file_wakes_the_watcher_at_most_once_and_stays_current(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    clock = FakeClock()
    with watching(path, clock, poll_seconds=0.5) as directory:
        assert directory._thread is not None
        time.sleep(0.2)  # its first look, after the watches began
        woke = wakeups_while_idle(directory._thread, 2.0)
        assert woke <= 1, f"the watcher ran {woke} times in 2 s on an unchanged file"
        clock.advance(5)
        assert directory.snapshot().last_contact_at == clock.now, "a watched good file is current"


def test_a_file_renamed_into_place_is_read_at_once(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    with watching(path, FakeClock()) as directory:
        write(path, pods_list(pod(UID_B, "b")))  # written beside, renamed over it
        wait_until(lambda: _uids(directory) == {PodUid(UID_B)}, timeout=PROMPTLY, interval=0.02)


def test_a_watcher_whose_descriptors_are_past_1024_reads_a_change_at_once(tmp_path: Path) -> None:
    """Started while the enforcer holds a thousand pins, the watcher's wake pipe and inotify
    descriptor are numbered past FD_SETSIZE: its wait was a ``select(2)``, which raised
    ValueError and ended the watcher thread, so the pods file was never read again."""
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    with descriptors_past_fd_setsize(), watching(path, FakeClock()) as directory:
        write(path, pods_list(pod(UID_B, "b")))
        wait_until(lambda: _uids(directory) == {PodUid(UID_B)}, timeout=PROMPTLY, interval=0.02)
        assert directory._thread is not None
        assert directory._thread.is_alive()


def test_a_file_written_in_place_is_read_at_once(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    with watching(path, FakeClock()) as directory:
        path.write_text(pods_list(pod(UID_A, "a"), pod(UID_B, "b")))
        wait_until(
            lambda: _uids(directory) == {PodUid(UID_A), PodUid(UID_B)},
            timeout=PROMPTLY,
            interval=0.02,
        )


def test_a_configmap_style_link_swap_is_read_at_once(tmp_path: Path) -> None:
    """A ConfigMap volume: ``pods.yaml -> ..data/pods.yaml``, ``..data -> ..v1``; an update
    writes ``..v2`` and renames a new ``..data`` link over the old one. Neither ``pods.yaml``
    nor the directory it points into changes."""
    (tmp_path / "..v1").mkdir()
    write(tmp_path / "..v1" / "pods.yaml", pods_list(pod(UID_A, "a")))
    (tmp_path / "..data").symlink_to("..v1")
    path = tmp_path / "pods.yaml"
    path.symlink_to("..data/pods.yaml")
    assert watch_points(str(path)) == {
        str(tmp_path): frozenset({"pods.yaml", "..data"}),
        str(tmp_path / "..v1"): frozenset({"pods.yaml"}),
    }
    with watching(path, FakeClock()) as directory:
        (tmp_path / "..v2").mkdir()
        write(tmp_path / "..v2" / "pods.yaml", pods_list(pod(UID_B, "b")))
        (tmp_path / "..data_tmp").symlink_to("..v2")
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
        wait_until(lambda: _uids(directory) == {PodUid(UID_B)}, timeout=PROMPTLY, interval=0.02)
        shutil.rmtree(tmp_path / "..v1")
        # Now the file is in ..v2: a change there is seen too.
        write(tmp_path / "..v2" / "pods.yaml", pods_list(pod(UID_A, "a")))
        wait_until(lambda: _uids(directory) == {PodUid(UID_A)}, timeout=PROMPTLY, interval=0.02)


def test_an_unwatchable_file_is_polled_until_it_can_be_watched_again(tmp_path: Path) -> None:
    """The directory goes: its watch with it, and nothing can be watched there; the watcher
    falls back to a look every poll interval, and watches again once the directory is back."""
    home = tmp_path / "pods"
    home.mkdir()
    path = home / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    clock = FakeClock()
    with capture_logs() as logs, watching(path, clock, poll_seconds=0.05) as directory:
        shutil.rmtree(home)
        wait_until(lambda: directory.problem() is not None, timeout=PROMPTLY, what="gone")
        wait_until(
            lambda: "pods_file_polled" in [entry["event"] for entry in logs],
            timeout=PROMPTLY,
            what="polling",
        )
        assert directory._thread is not None
        woke = wakeups_while_idle(directory._thread, 0.5)
        assert woke >= 5, f"polling every 0.05 s, the watcher ran only {woke} times in 0.5 s"
        home.mkdir()
        write(path, pods_list(pod(UID_B, "b")))
        wait_until(lambda: _uids(directory) == {PodUid(UID_B)}, timeout=PROMPTLY, what="back")
        wait_until(
            lambda: "pods_file_watched" in [entry["event"] for entry in logs],
            timeout=PROMPTLY,
            what="watched again",
        )
        woke = wakeups_while_idle(directory._thread, 1.0)
        assert woke <= 1, f"watched again, the watcher still ran {woke} times in 1 s"


def test_stop_ends_the_watcher_at_once(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    write(path, pods_list(pod(UID_A, "a")))
    directory = FilePodDirectory(path, node_name="node-1", clock=FakeClock(), poll_seconds=60.0)
    directory.start()
    thread = directory._thread
    assert thread is not None
    started = time.monotonic()
    directory.stop()
    took = time.monotonic() - started
    assert not thread.is_alive()
    assert took < 0.5, f"stop() took {took:.2f} s"


def test_the_watch_points_follow_links_as_the_kernel_does(tmp_path: Path) -> None:
    """``link/..`` is the parent of the link's target, not ``tmp_path``."""
    (tmp_path / "deep" / "inner").mkdir(parents=True)
    (tmp_path / "link").symlink_to("deep/inner")
    path = f"{tmp_path}/link/../pods.yaml"
    assert watch_points(path) == {
        str(tmp_path): frozenset({"link"}),
        str(tmp_path / "deep"): frozenset({"pods.yaml"}),
    }
    relative = os.path.relpath(tmp_path / "deep" / "pods.yaml")
    assert watch_points(relative) == {str(tmp_path / "deep"): frozenset({"pods.yaml"})}
