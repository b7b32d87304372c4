"""A bug inside a reflector's thread (the one thread runner every watcher uses: pods, Node,
ConfigMaps, the agent's) is logged and reported as the watcher's problem, never a thread that
dies silently while the cache it feeds goes stale unnoticed."""

from __future__ import annotations

import threading
from typing import Any

from gpuguard.adapters.kube.reflector import Reflector, raw
from gpuguard.errors import GpuguardError, KubeError


def test_a_bug_in_the_watcher_thread_becomes_its_problem() -> None:
    problems: list[GpuguardError | None] = []

    def call(**kwargs: Any) -> Any:
        raise RuntimeError("a bug, not a Kubernetes failure")

    reflector = Reflector(
        name="pods",
        call=call,
        field_selector="spec.nodeName=n1",
        resource="pods",
        scope="cluster scope",
        translate=raw,
        on_replace=lambda items: None,
        on_event=lambda kind, obj: None,
        on_contact=lambda: None,
        on_problem=problems.append,
        stop_event=threading.Event(),
        health=None,
        watch_timeout_seconds=1,
        connect_timeout_seconds=1,
        inactivity_seconds=1,
    )
    thread = reflector.thread("gpuguard-test-pods")
    assert thread.daemon
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert len(problems) == 1
    assert isinstance(problems[0], KubeError)
    assert "pods watcher crashed: a bug, not a Kubernetes failure" in str(problems[0])
