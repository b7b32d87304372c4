"""A generic reflector: list one resource by field (or label) selector, then watch it from the
list's resourceVersion, in a thread of its own; 410 → relist; errors → the one retry loop.

Owns the list (paged, one consistent view) and watch protocol (bookmarks, ``ERROR`` events,
server-side timeouts, a watch gone silent) of one selector, and the count of its restarts. Each
object goes through its owner's ``translate`` as soon as it is read, and only what that returns
is handed on (``pods``, ``nodes``, …); the reflector never interprets an object itself. Errors
are classified by ``errors`` and waited out by ``retry`` only.

Memory: an object's size is its writer's choice (a tenant's pod may carry 256 KiB of
annotations, and up to etcd's 1.5 MiB in all), so no raw object outlives its translation. A list
is read one page (``limit``) at a time and each page is translated before the next is asked for
(the raw body is read uncached, ``read()`` rather than ``.data``, and dropped with the frame that
parsed it); a watch event is translated as it is parsed. What stays is what ``translate`` keeps.

Threads, not asyncio tasks: the sync client blocks in socket reads for the whole life of a watch.
A blocked ``asyncio.to_thread`` call cannot be cancelled and pins a default-executor worker, so
loop shutdown would hang on it. ``interrupt()`` (from ``stop()``) closes the open response, which
ends a blocked read at once.

Objects are read as raw JSON (``_preload_content=False``): one ``json.loads`` per event instead of
the client's model deserialisation, and no client model types leak into the translation code.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import structlog

from gpuguard.adapters.kube.errors import (
    Decision,
    ResourceExpired,
    decision,
    restart_reason,
    status_error,
    translate_error,
)
from gpuguard.adapters.kube.retry import retrying
from gpuguard.errors import GpuguardError, KubeError
from gpuguard.ports import HealthRecorder

log = structlog.get_logger(__name__)

MAX_LIST_PAGES = 10_000
POD_PAGE_SIZE = 10
"""Pods per list page (the enforcer's directory, the agent). A page's raw JSON is the most a
reader of pods holds at once of what tenants wrote: a pod may be up to etcd's 1.5 MiB (256 KiB
of it annotations), so 10 are at most about 15 MiB of body and as much parsed, where 500 (the
usual page) could be the whole node. A relist of a 110-pod node is 11 requests."""

T = TypeVar("T")


def raw(obj: dict[str, Any]) -> dict[str, Any]:
    """The ``translate`` of an owner that keeps the object as it came: one that is written by
    an admin or a controller, never by a tenant, and bounded in number (a Node by name, a
    ConfigMap by name, this node's ResourceSlices)."""
    return obj


class Stopped(Exception):
    """Raised inside a retried call when ``stop()`` was requested; never retried."""


class Reflector(Generic[T]):
    """List, then watch; every watch window, relist and retry goes through ``retry.retrying``.

    ``translate`` turns each object read (a list's, an event's) into what the owner keeps;
    ``on_replace`` receives the translation of every object of a (re)list, ``on_event`` each
    watch event's;
    ``on_contact`` is called after every successful answer from the API server; ``on_problem``
    gets a reported error (``errors.Decision.REPORT``) and ``None`` once a list worked again.
    Restarts are counted as ``health.count_watch_restart(resource, reason)``: ``timeout`` when
    the server ended a watch at its ``timeoutSeconds`` (expected once per window), ``expired``
    for a 410, ``inactivity`` for a connection gone silent, ``error`` for anything else.
    """

    def __init__(
        self,
        *,
        name: str,
        call: Callable[..., Any],
        field_selector: str | None,
        resource: str,
        scope: str,
        translate: Callable[[dict[str, Any]], T],
        on_replace: Callable[[list[T]], None],
        on_event: Callable[[str, T], None],
        on_contact: Callable[[], None],
        on_problem: Callable[[GpuguardError | None], None],
        stop_event: threading.Event,
        health: HealthRecorder | None,
        watch_timeout_seconds: float,
        connect_timeout_seconds: float,
        inactivity_seconds: float,
        page_size: int = 500,
        label_selector: str | None = None,
    ) -> None:
        self.name = name
        self._call = call
        self._selectors: dict[str, str] = {}
        if field_selector is not None:
            self._selectors["field_selector"] = field_selector
        if label_selector is not None:
            self._selectors["label_selector"] = label_selector
        self._resource = resource
        self._scope = scope
        self._translate_object = translate
        self._on_replace = on_replace
        self._on_event = on_event
        self._on_contact = on_contact
        self._on_problem = on_problem
        self._stop = stop_event
        self._health = health
        self._watch_timeout = watch_timeout_seconds
        self._connect_timeout = connect_timeout_seconds
        self._inactivity = inactivity_seconds
        self._page_size = page_size
        self._rv: str | None = None
        self._needs_list = True
        self._resp_lock = threading.Lock()
        self._resp: Any = None

    def interrupt(self) -> None:
        """Close the open response (from another thread) so a blocked read returns now."""
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            with contextlib.suppress(AttributeError, OSError):
                resp.shutdown()  # urllib3 >= 2.3: unblocks a read in another thread
            with contextlib.suppress(OSError, ValueError, AttributeError):
                resp.close()

    def thread(self, thread_name: str) -> threading.Thread:
        """A daemon thread (not started) running ``run``; a bug that escapes it is logged and
        becomes ``on_problem``'s ``KubeError`` instead of a thread dying silently."""
        return threading.Thread(target=self._guarded, name=thread_name, daemon=True)

    def _guarded(self) -> None:
        try:
            self.run()
        except Exception as exc:  # a bug must not kill the thread silently
            log.exception("kube_watcher_crashed", watcher=self.name)
            self._on_problem(KubeError(f"{self.name} watcher crashed: {exc}"))

    def run(self) -> None:
        """Until ``stop_event``: one retried call per watch window (a success resets the
        backoff). Raises only an error that is not a Kubernetes failure (a bug)."""
        try:
            while not self._stop.is_set():
                retrying(self._stop, what=self.name, persist=True, on_retry=self._on_retry)(
                    self._step
                )
                self._restarted("timeout")
        except Stopped:
            pass
        except GpuguardError:
            if not self._stop.is_set():
                raise

    def _step(self) -> None:
        """List when needed (first, after a 410), then one watch window."""
        if self._stop.is_set():
            raise Stopped
        if self._needs_list:
            self._list()
        try:
            self._watch()
        except ResourceExpired:
            self._needs_list = True
            raise

    def _on_retry(self, error: BaseException) -> None:
        if self._stop.is_set():
            return
        self._restarted(restart_reason(error))
        verdict = decision(error)
        if verdict is Decision.RELIST:
            log.info("kube_watch_gone", watcher=self.name, reason=str(error))
        elif verdict is Decision.REPORT and isinstance(error, GpuguardError):
            self._on_problem(error)

    def _restarted(self, reason: str) -> None:
        if self._health is not None and not self._stop.is_set():
            self._health.count_watch_restart(self._resource, reason)

    def _request(self, verb: str, **kwargs: Any) -> Any:
        try:
            return self._call(**self._selectors, _preload_content=False, **kwargs)
        except Exception as exc:
            raise self._translate(exc, verb) from exc

    def _translate(self, exc: BaseException, verb: str) -> BaseException:
        return translate_error(exc, verb=verb, resource=self._resource, scope=self._scope)

    def _list(self) -> None:
        """All pages of one list; a 410 between pages (continue token expired) relists. Each
        page is translated before the next one is asked for (``_page``)."""
        self._needs_list = True
        items: list[T] = []
        cont: str | None = None
        for _ in range(MAX_LIST_PAGES):
            translated, cont, version = self._page(cont)
            items.extend(translated)
            if cont is None:
                self._rv = version
                break
        self._needs_list = False
        self._on_contact()  # before the data, so a synced snapshot always has a contact time
        self._on_replace(items)
        self._on_problem(None)

    def _page(self, cont: str | None) -> tuple[list[T], str | None, str | None]:
        """One page, translated: its objects, the continue token (``None`` on the last page) and
        the list's resourceVersion. The raw body lives in this frame only."""
        kwargs: dict[str, Any] = {"limit": self._page_size}
        if cont:
            kwargs["_continue"] = cont
        resp = self._request(
            "list", _request_timeout=(self._connect_timeout, self._inactivity), **kwargs
        )
        try:
            # read(), not .data: .data keeps the body on the response object.
            body = json.loads(resp.read())
        except Exception as exc:
            raise self._translate(exc, "list") from exc
        finally:
            resp.release_conn()
        if not isinstance(body, dict):
            raise self._translate(ValueError(f"a list answered {type(body).__name__}"), "list")
        translated = [
            self._translate_object(i) for i in body.get("items") or () if isinstance(i, dict)
        ]
        meta = body.get("metadata") or {}
        cont = meta.get("continue") or None
        version = str(meta.get("resourceVersion") or "") or None
        return translated, cont if isinstance(cont, str) else None, version

    def _watch(self) -> None:
        """One watch request; returns at the server's timeout, raises on error or 410."""
        spread = random.uniform(0.8, 1.0)  # noqa: S311 - spreads re-watches of a fleet
        server_timeout = max(1, int(self._watch_timeout * spread))
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": server_timeout,
            "_request_timeout": (self._connect_timeout, server_timeout + self._inactivity),
        }
        if self._rv:
            kwargs["resource_version"] = self._rv
        resp = self._request("watch", **kwargs)
        with self._resp_lock:
            self._resp = resp
        if self._stop.is_set():  # stop() ran before _resp was set: it could not interrupt us
            self._release(resp)
            raise Stopped
        self._on_contact()
        try:
            for line in iter_lines(resp):
                if self._stop.is_set():
                    raise Stopped
                self._handle(json.loads(line))
            self._on_contact()  # the server closed the watch at timeoutSeconds: a contact
        except (Stopped, GpuguardError):
            raise
        except Exception as exc:
            if self._stop.is_set():
                raise Stopped from exc
            raise self._translate(exc, "watch") from exc
        finally:
            self._release(resp)

    def _release(self, resp: Any) -> None:
        with self._resp_lock:
            self._resp = None
        with contextlib.suppress(Exception):
            # A watch can end mid-stream (stop, inactivity): close the connection rather than
            # hand a socket with unread bytes back to the pool.
            resp.close()
            resp.release_conn()

    def _handle(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":  # a Status object: classified by the same table as a response
            code = obj.get("code")
            raise status_error(
                code if isinstance(code, int) else 500,
                str(obj.get("message") or obj),
                verb="watch",
                resource=self._resource,
                scope=self._scope,
            )
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(obj, dict):
            self._on_event(kind, self._translate_object(obj))
        if isinstance(rv, str) and rv:
            self._rv = rv
        self._on_contact()


def iter_lines(resp: Any) -> Iterator[bytes]:
    """The newline-delimited JSON events of a watch response, as they arrive."""
    buffer = bytearray()
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer.extend(chunk)
        while (nl := buffer.find(b"\n")) != -1:
            line = bytes(buffer[:nl]).strip()
            del buffer[: nl + 1]
            if line:
                yield line
    if buffer.strip():
        yield bytes(buffer).strip()
