"""DRA for this node's pods: its ResourceSlices and the ResourceClaims its pods use
(``DraReader``), the claims read one by one (``ClaimCache``).

Owns the reads of DRA claims for ``KubePodDirectory`` (docs/dra.md): a GET by namespace/name of
each claim the node's pods name, in one daemon thread, cached by ``resourceVersion`` and dropped
once no pod names it. Never a list or watch of ResourceClaims: there is no field selector on a
claim's node, and a cluster-wide watch from every node would send every claim of the cluster to
every node (docs/design.md, DRA memory shares). Errors are classified by ``errors`` and spaced by
``retry.wait_seconds`` (the one ladder); must not interpret a claim beyond ``dra.claim_from_json``
and never blocks ``states()``.

What a claim key maps to in ``states()``: the ``Claim`` read; ``MISSING`` when the API server
answered 404 (a claim deleted with its pod: the share is forgotten); the error text when it
answered something it will answer again (403, 422), or when the claim is past the node's budget
(the declaration is then unresolved: the pod is held like one that declares nothing). A claim not
read yet is absent (unresolved too). A transient failure (no answer, 5xx) keeps the last read: a
claim's allocation cannot change once set, and an outage is judged by the pod watch's contact
time, as for the pods themselves.

Which claims are read (``dra.ration_claims``): at most ``MAX_CLAIMS``, those of running pods
first, namespaces taking turns; a claim that answered 404 takes no slot of it, and up to
``MAX_MISSING`` of those are read again. Anyone can name claims that do not exist (a pod with
``spec.nodeName`` set skips the scheduler, and nothing checks its claims): they must not crowd
out the claims of pods with GPU processes, nor one namespace's claims another's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.kube.errors import Decision, decision, translate_error
from gpuguard.adapters.kube.reflector import Reflector, raw
from gpuguard.adapters.kube.retry import wait_seconds
from gpuguard.core.model import Declaration, PodUid
from gpuguard.errors import GpuguardError
from gpuguard.kubemodel.dra import (
    Claim,
    ClaimKey,
    PodClaims,
    claim_from_json,
    dra_declaration,
    pod_claims,
    ration_claims,
    slice_devices,
)
from gpuguard.ports import Clock

log = structlog.get_logger(__name__)

MISSING = "missing"
"""A claim the API server does not have (404)."""

REFRESH_SECONDS = 60.0
"""How long a claim read stays good before it is read again. An allocation cannot change once
set (``status.allocation`` is immutable, even for cluster-admin), and a claim is re-read at once
whenever the pods naming it change (a new pod, a pod gone: ``reservedFor`` changes with them);
the refresh only catches what no pod change announces: a shared claim deallocated or deleted
while a pod still names it. One GET per claim per minute is 8 requests per node per minute with
8 DRA pods (docs/scale.md), against a watch that would carry every claim of the cluster."""

SETTLE_SECONDS = 5.0
"""A claim whose pods changed is read at once and once more this much later: the ResourceClaim
controller drops a deleted pod from ``reservedFor`` only after the pod is gone, so the first read
can still list it."""

MAX_CLAIMS = 512
"""Claims read per node (110 pods by default, a few claims each), those of running pods first,
namespaces taking turns (``dra.ration_claims``). Past it a claim is never read: its pods are
unresolved (held like pods that declare nothing), and the cap is reported."""

MAX_MISSING = 64
"""Claims that answered 404 still read again (every ``REFRESH_SECONDS``), beyond
``MAX_CLAIMS``: a claim that does not exist grants nothing and takes no slot of the budget;
past this many, one is not read again until the pods naming it change."""

PASS_SECONDS = 1.0
"""The longest a pass of reads runs before what it read is published and the claims are
rationed afresh (sooner when the pods' claims change). A full pass is up to ``MAX_CLAIMS``
GETs: at 0.1 s each (a loaded API server) a minute in which no claim read, not even a running
pod's, would reach the enforcer, and claims found gone would hold no slot free for others."""

MAX_NAME = 253
"""The longest namespace or name the API server accepts (a DNS subdomain)."""


@dataclass(slots=True)
class _Entry:
    state: Claim | str | None = None
    """``None``: never read."""
    resource_version: str = ""
    due: float = 0.0
    """When to read it next (monotonic)."""
    failures: int = 0
    settle: bool = False
    """Read it once more ``SETTLE_SECONDS`` after this read: its pods just changed."""
    read_at: float | None = None
    """When the GET behind ``state`` was sent (the clock's monotonic seconds)."""
    reread: bool = False
    """A violation waits for this read (``ClaimCache.reread``): publish it even unchanged."""
    missing: bool = False
    """Its last read answered 404 (kept while it is past the budget): it takes no slot of
    ``MAX_CLAIMS``. Cleared when the pods naming it change."""


class ClaimCache:
    """GET each wanted claim; ``on_change`` after any change of ``states()``."""

    def __init__(
        self,
        resource_api: Any,
        *,
        stop_event: threading.Event,
        on_change: Callable[[], None],
        on_problem: Callable[[GpuguardError | None], None],
        on_contact: Callable[[], None] = lambda: None,
        refresh_seconds: float = REFRESH_SECONDS,
        max_claims: int = MAX_CLAIMS,
        max_missing: int = MAX_MISSING,
        request_timeout_seconds: float = 10.0,
        clock: Clock | None = None,
    ) -> None:
        """``resource_api``: a ``kubernetes.client.ResourceV1Api``; ``clock``: the one the
        enforcer decides by (``read_times`` are compared with its moments)."""
        self._api = resource_api
        self._clock: Clock = clock or SystemClock()
        self._stop = stop_event
        self._on_change = on_change
        self._on_problem = on_problem
        self._on_contact = on_contact
        self._refresh = refresh_seconds
        self._max = max_claims
        self._max_missing = max_missing
        self._timeout = request_timeout_seconds
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._wanted: dict[ClaimKey, frozenset[str]] = {}
        self._running: frozenset[str] = frozenset()
        self._over = 0
        self._order: dict[ClaimKey, int] = {}
        """Each claim's place in the last ration (``_prune``): the order of reads."""
        self._entries: dict[ClaimKey, _Entry] = {}
        self._view: Mapping[ClaimKey, Claim | str] = MappingProxyType({})
        self._read_times: Mapping[ClaimKey, float] = MappingProxyType({})
        self._problem: GpuguardError | None = None

    # -- called by the directory ------------------------------------------------------------

    def want(self, users: Mapping[ClaimKey, Iterable[str]], running: Iterable[str] = ()) -> None:
        """The claims the node's pods name now, each with the UIDs of the pods naming it, and
        the UIDs of those pods that run (``PodClaims.running``). A new claim, or one whose pods
        changed, is read at once (within the budget); one no pod names is dropped."""
        wanted = {key: frozenset(uids) for key, uids in users.items()}
        runs = frozenset(running)
        with self._lock:
            if wanted == self._wanted and runs == self._running:
                return
            for key, uids in wanted.items():
                entry = self._entries.get(key)
                if entry is not None and self._wanted.get(key) != uids:
                    entry.due, entry.settle, entry.missing = 0.0, True, False
            self._wanted, self._running = wanted, runs
        self._wake.set()

    def reread(self, asked: Mapping[ClaimKey, float]) -> None:
        """Read each claim again unless its last answer was asked for after the moment given
        (a violation due to be acted on waits for it: ``core.policy``). Asking again before the
        read is done sends no second GET."""
        with self._lock:
            woke = False
            for key, since in asked.items():
                entry = self._entries.get(key)
                if entry is None:
                    continue  # not wanted
                if entry.read_at is not None and entry.read_at >= since:
                    continue
                if entry.due == float("inf"):
                    # Past the budget: the next pass finds it there again (or not) and says
                    # so with a fresh moment; no GET.
                    entry.reread, woke = True, True
                    continue
                if not entry.reread or entry.due > 0.0:
                    entry.reread, entry.due, woke = True, min(entry.due, 0.0), True
        if woke:
            self._wake.set()

    def states(self) -> Mapping[ClaimKey, Claim | str]:
        """What is known of each wanted claim (see the module docstring); never blocks long."""
        with self._lock:
            return self._view

    def read_times(self) -> Mapping[ClaimKey, float]:
        """When the GET behind each state of ``states()`` was sent (same clock as the
        enforcer's); published with it."""
        with self._lock:
            return self._read_times

    def interrupt(self) -> None:
        self._wake.set()

    def thread(self, thread_name: str) -> threading.Thread:
        return threading.Thread(target=self._guarded, name=thread_name, daemon=True)

    # -- the reader thread ------------------------------------------------------------------

    def _guarded(self) -> None:
        try:
            self.run()
        except Exception as exc:  # a bug must not kill the thread silently
            log.exception("kube_watcher_crashed", watcher="resourceclaims")
            self._on_problem(GpuguardError(f"resourceclaims reader crashed: {exc}"))

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            changed = self._prune()
            ends = time.monotonic() + PASS_SECONDS
            for key in self._due():
                if self._stop.is_set():
                    return
                changed |= self._read(key)
                if self._wake.is_set() or time.monotonic() >= ends:
                    break  # what was read is published; the rest stays due, rationed afresh
            if changed:
                self._publish()
                self._on_change()
            self._report()
            self._wake.wait(self._seconds_to_next())

    def _prune(self) -> bool:
        """Forget claims no pod names; ration the rest (``dra.ration_claims``) and mark those
        past the budget, with the moment they were found there (``read_times``)."""
        now = self._clock.monotonic()
        with self._lock:
            wanted = {k: bool(uids & self._running) for k, uids in self._wanted.items()}
            dropped = [k for k in self._entries if k not in wanted]
            for key in dropped:
                del self._entries[key]
            changed = bool(dropped)
            gone = [k for k in wanted if k in self._entries and self._entries[k].missing]
            read, again = ration_claims(
                wanted, gone, budget=self._max, missing_budget=self._max_missing
            )
            allowed = {*read, *again}
            self._order = {k: i for i, k in enumerate((*read, *again))}
            over = (
                f"over the cap of {self._max} ResourceClaims per node (those of running pods "
                "first, each namespace in turn): not read"
            )
            for key in wanted:
                entry = self._entries.setdefault(key, _Entry())
                if key in allowed:
                    if entry.due == float("inf"):
                        entry.due = 0.0
                    continue
                entry.due = float("inf")
                if entry.state != over or entry.reread:
                    entry.state, entry.resource_version, changed = over, "", True
                    entry.read_at, entry.reread = now, False
            past, self._over = self._over, len(wanted) - len(allowed)
        if self._over and self._over != past:
            log.warning(
                "dra_claims_over_cap",
                claims=len(wanted),
                read=len(read),
                missing_read=len(again),
                not_read=self._over,
                cap=self._max,
            )
        return changed

    def _due(self) -> list[ClaimKey]:
        """The claims due for a read, in the ration's order (running pods' first, namespaces
        taking turns), so that a pass cut short has read those that matter most."""
        now = time.monotonic()
        with self._lock:
            due = [k for k, e in self._entries.items() if e.due <= now]
            last = len(self._order)
            return sorted(due, key=lambda k: self._order.get(k, last))

    def _seconds_to_next(self) -> float:
        with self._lock:
            due = min((e.due for e in self._entries.values()), default=float("inf"))
        return max(0.05, min(self._refresh, due - time.monotonic()))

    def _read(self, key: ClaimKey) -> bool:
        """One GET; the new state of ``key`` (``True`` when it changed)."""
        state: Claim | str | None
        version = ""
        error: BaseException | None = None
        sent = self._clock.monotonic()
        if len(key.namespace) > MAX_NAME or len(key.name) > MAX_NAME:
            return self._store(
                key, "a claim name longer than the API server accepts", "", None, sent
            )
        try:
            resp = self._api.read_namespaced_resource_claim(
                key.name, key.namespace, _preload_content=False, _request_timeout=self._timeout
            )
            try:
                obj = json.loads(resp.data)
            finally:
                resp.release_conn()
            state = claim_from_json(obj)
            if state is None:
                state = "not a ResourceClaim"
            else:
                version = state.resource_version or ""
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == 404:
                state = MISSING
            else:
                error = translate_error(
                    exc, verb="get", resource="resourceclaims", scope=f"namespace {key.namespace!r}"
                )
                if decision(error) is None:
                    raise  # not a Kubernetes failure: a bug
                state = None
        if error is None:
            self._on_contact()
        return self._store(key, state, version, error, sent)

    def _store(
        self,
        key: ClaimKey,
        state: Claim | str | None,
        version: str,
        error: BaseException | None,
        sent: float,
    ) -> bool:
        """Record one read's outcome; ``True`` when ``states()`` or ``read_times()`` a
        violation waits for changes."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:  # no pod names it any more
                return False
            if error is None:
                entry.failures = 0
                entry.missing = state == MISSING
                entry.due = now + (SETTLE_SECONDS if entry.settle else self._refresh)
                entry.settle = False
                entry.read_at = sent
                waited, entry.reread = entry.reread, False
                same = bool(version) and version == entry.resource_version
                if same and isinstance(entry.state, Claim):
                    return waited  # cached by resourceVersion
                changed = state != entry.state
                entry.state, entry.resource_version = state, version
                return changed or waited
            entry.failures += 1
            entry.due = now + wait_seconds(error, attempt=entry.failures)
            if decision(error) is not Decision.REPORT:
                return False  # transient: keep what was read (or nothing: unresolved)
            # The API server will answer the same again (403, 422): the declaration is
            # unresolved, and the directory's problem() says why.
            if isinstance(error, GpuguardError):
                self._problem = error
            changed = entry.state != str(error)
            entry.state, entry.resource_version, entry.read_at = str(error), "", sent
            entry.missing = False
            waited, entry.reread = entry.reread, False
            return changed or waited

    def _publish(self) -> None:
        with self._lock:
            self._view = MappingProxyType(
                {k: e.state for k, e in self._entries.items() if e.state is not None}
            )
            self._read_times = MappingProxyType(
                {k: e.read_at for k, e in self._entries.items() if e.read_at is not None}
            )

    def _report(self) -> None:
        """The problem: the last permanent answer while any claim still carries one."""
        with self._lock:
            failing = any(
                e.failures and isinstance(e.state, str) and e.state != MISSING
                for e in self._entries.values()
            )
            if not failing:
                self._problem = None
            problem = self._problem
        self._on_problem(problem)


MAX_SLICES = 256
"""ResourceSlices kept for one node (NVIDIA's driver publishes one per node, or one per GPU with
DynamicMIG, plus the other drivers'); past it a slice is ignored and its devices stay unplaced
(their shares unresolved)."""


class DraReader:
    """The DRA side of ``KubePodDirectory``: this node's ResourceSlices (a reflector with
    ``fieldSelector spec.nodeName=<node>``), the claims its pods name (``ClaimCache``), and each
    pod's ``dra`` declaration from them (``kubemodel.dra.dra_declaration``).

    Until the first slice list answered, every pod naming a claim is unresolved: without the
    node's slices no share can be placed on a GPU, and a limit there would be a guess.
    """

    def __init__(
        self,
        api: Any,
        *,
        node_name: str,
        stop_event: threading.Event,
        on_change: Callable[[], None],
        on_problem: Callable[[str, GpuguardError | None], None],
        health: Any,
        clock: Clock | None = None,
        refresh_seconds: float = REFRESH_SECONDS,
        max_claims: int = MAX_CLAIMS,
        max_missing: int = MAX_MISSING,
        **timeouts: Any,
    ) -> None:
        resource: Any = k8s.ResourceV1Api(api)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._pods: dict[str, PodClaims] = {}
        self._slices: dict[str, dict[str, Any]] = {}
        self._devices: Mapping[Any, Any] = MappingProxyType({})
        self._slices_synced = False
        self.claims = ClaimCache(
            resource,
            stop_event=stop_event,
            on_change=on_change,
            on_problem=lambda p: on_problem("claims", p),
            refresh_seconds=refresh_seconds,
            max_claims=max_claims,
            max_missing=max_missing,
            clock=clock,
            request_timeout_seconds=float(timeouts.get("connect_timeout_seconds", 5.0))
            + float(timeouts.get("inactivity_seconds", 15.0)),
        )
        self.reflector = Reflector(
            name="resourceslices",
            call=resource.list_resource_slice,
            field_selector=f"spec.nodeName={node_name}",
            resource="resourceslices",
            scope="cluster scope",
            translate=raw,
            on_replace=self._replace_slices,
            on_event=self._slice_event,
            on_contact=lambda: None,
            on_problem=lambda p: on_problem("slices", p),
            stop_event=stop_event,
            health=health,
            **timeouts,
        )

    def threads(self) -> list[threading.Thread]:
        return [
            self.reflector.thread("gpuguard-kube-resourceslices"),
            self.claims.thread("gpuguard-kube-resourceclaims"),
        ]

    def interrupt(self) -> None:
        self.reflector.interrupt()
        self.claims.interrupt()

    # -- pods (from the directory's pod watcher) -----------------------------------------------

    @staticmethod
    def claims_of(manifest: Mapping[str, Any]) -> PodClaims:
        """The claims one pod's manifest names, read as the pod watcher translates it: the
        manifest itself is not kept."""
        return pod_claims(manifest)

    def pods_replaced(self, found: Mapping[str, PodClaims]) -> None:
        """Every pod of the node (uid → ``claims_of`` its manifest) after a (re)list."""
        with self._lock:
            self._pods = {uid: pc for uid, pc in found.items() if _names_claims(pc)}
        self._want()

    def pod_changed(self, uid: str, found: PodClaims | None) -> None:
        """One pod added or modified (``claims_of`` its manifest), or gone (``None``)."""
        with self._lock:
            if found is not None and _names_claims(found):
                if self._pods.get(uid) == found:
                    return
                self._pods = {**self._pods, uid: found}
            elif uid in self._pods:
                self._pods = {k: v for k, v in self._pods.items() if k != uid}
            else:
                return
        self._want()

    def _want(self) -> None:
        with self._lock:
            pods = self._pods
        users: dict[ClaimKey, set[str]] = {}
        for uid, pc in pods.items():
            for use in pc.uses:
                users.setdefault(use.key, set()).add(uid)
        self.claims.want(users, running=[uid for uid, pc in pods.items() if pc.running])

    def reread(self, asked: Mapping[PodUid, float]) -> None:
        """Each pod's claims read again unless read since its moment (``ClaimCache.reread``)."""
        with self._lock:
            pods = self._pods
        keys: dict[ClaimKey, float] = {}
        for uid, since in asked.items():
            pc = pods.get(uid)
            for use in pc.uses if pc is not None else ():
                keys[use.key] = max(since, keys.get(use.key, since))
        self.claims.reread(keys)

    # -- the view --------------------------------------------------------------------------

    def declarations(self) -> dict[str, Declaration]:
        """Each pod naming a claim → its ``dra`` declaration, with when its least recently read
        claim was read (never blocks long)."""
        with self._lock:
            pods, devices, synced = self._pods, self._devices, self._slices_synced
        claims, read_times = self.claims.states(), self.claims.read_times()
        out: dict[str, Declaration] = {}
        for uid, pc in pods.items():
            decl = dra_declaration(pc, claims, devices)
            if decl is None:
                continue
            times = [read_times.get(use.key) for use in pc.uses]
            if not synced:  # no read_at either: a violation waits for the slices too
                decl = replace(decl, unresolved="this node's ResourceSlices are not listed yet")
            elif times and all(t is not None for t in times):
                decl = replace(decl, read_at=min(t for t in times if t is not None))
            out[uid] = decl
        return out

    # -- slices (from the reflector thread) ------------------------------------------------

    def _replace_slices(self, items: list[dict[str, Any]]) -> None:
        slices: dict[str, dict[str, Any]] = {}
        for obj in items:
            name = _name(obj)
            if name is not None and len(slices) < MAX_SLICES:
                slices[name] = obj
        if len(items) > MAX_SLICES:
            log.warning("dra_slices_over_cap", slices=len(items), cap=MAX_SLICES)
        self._set_slices(slices, synced=True)

    def _slice_event(self, kind: str, obj: dict[str, Any]) -> None:
        name = _name(obj)
        if name is None:
            return
        with self._lock:
            slices = dict(self._slices)
        if kind == "DELETED":
            slices.pop(name, None)
        elif name in slices or len(slices) < MAX_SLICES:
            slices[name] = obj
        self._set_slices(slices, synced=None)

    def _set_slices(self, slices: dict[str, dict[str, Any]], *, synced: bool | None) -> None:
        devices = MappingProxyType(dict(slice_devices(slices.values())))
        with self._lock:
            changed = devices != self._devices or (synced and not self._slices_synced)
            self._slices, self._devices = slices, devices
            if synced:
                self._slices_synced = True
        if changed:
            self._on_change()


def _names_claims(pc: PodClaims) -> bool:
    return bool(pc.uses or pc.pending or pc.errors)


def _name(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and 0 < len(name) <= MAX_NAME else None
