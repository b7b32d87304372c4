"""A one-shot command's wait for the DRA reads behind its pods' limits (``explain``, ``inspect``).

The pod directory reads this node's ResourceSlices and its pods' ResourceClaims in the background,
after the first pod list (``adapters.kube.dra_claims``); until they answered, a pod's ``dra``
declaration is unresolved, and no limit is resolved for it. The enforcer just judges the pod
again at its next poll; a command that reads the directory once, right after ``wait_synced``,
would show a pod with a DRA share as having no limit. Owns only that wait: it polls snapshots,
and changes and reads nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from gpuguard.core.model import LimitSource, PodSnapshot, PodUid
from gpuguard.ports import PodDirectory

POLL_SECONDS = 0.05
"""How often the snapshot is looked at while waiting."""


def wait_for_dra_reads(
    directory: PodDirectory,
    uids: Collection[PodUid],
    timeout_seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Block until none of the pods ``uids`` (those of ``directory``'s snapshot) has a ``dra``
    declaration still unresolved, or ``timeout_seconds`` passed; returns whether none has.
    A pod whose claims cannot be read (forbidden, or a claim it names that is not allocated)
    stays unresolved: the wait then lasts the whole timeout, and the command shows the pod as
    the enforcer judges it (no limit, the reason in its errors)."""
    deadline = clock() + timeout_seconds
    while unresolved_dra(directory.snapshot(), uids):
        if clock() >= deadline:
            return False
        sleep(POLL_SECONDS)
    return True


def unresolved_dra(snapshot: PodSnapshot, uids: Collection[PodUid]) -> list[PodUid]:
    """The pods among ``uids`` whose ``dra`` declaration is unresolved in ``snapshot``."""
    found = []
    for uid in uids:
        pod = snapshot.lookup(uid)
        declared = None if pod is None else pod.declared.get(LimitSource.DRA)
        if declared is not None and declared.unresolved is not None:
            found.append(uid)
    return found
