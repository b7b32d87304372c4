"""One GET against a server a test started on loopback: its status and body, whatever the
status.

Owns the request and its timeout. Must not retry or wait: a caller polling a server that is
still starting catches ``OSError`` (refused, reset, timed out) itself.
"""

from __future__ import annotations

import urllib.error
import urllib.request


def http_get(port: int, path: str, *, timeout: float = 5.0) -> tuple[int, str]:
    """GET ``http://127.0.0.1:<port><path>``: the status and the body as text; an error status
    (404, 503...) is returned like any other, not raised."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return int(e.code), e.read().decode()
