"""Listen addresses: ``host:port``, ``:port`` or ``[IPv6]:port`` taken apart.

Owns the one parser of listen addresses: the config checks ``metrics.address`` and
``agent.metrics_address`` with it and ``app.py`` binds what it returns. Must not bind or resolve
anything.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from gpuguard.config.messages import render

ADDRESS_FORM = (
    'must be "host:port" with a port from 0 to 65535 '
    '(e.g. "0.0.0.0:9410", ":9410" for all interfaces, "[::1]:9410")'
)
"""What is allowed, in every message about an address."""
_HOST_NAME = re.compile(r"[A-Za-z0-9]([-.A-Za-z0-9]*[A-Za-z0-9])?", re.ASCII)


class InvalidListenAddress(ValueError):
    """A rejected ``host:port``. ``str()`` names the value; ``problem`` is what is wrong and what
    is allowed (for messages that name the value already)."""

    def __init__(self, text: str, problem: str) -> None:
        self.text = text
        self.problem = f"{problem}; {ADDRESS_FORM}"
        super().__init__(f"{render(text)}: {self.problem}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenAddress:
    """Where to listen: ``metrics.address`` taken apart."""

    host: str
    """An IPv4 address, a host name, or an IPv6 address without its brackets; "" is every
    interface."""
    port: int
    """0 to 65535; 0 lets the kernel pick one."""


def parse_listen_address(text: str) -> ListenAddress:
    """``host:port``, ``:port`` or ``[IPv6]:port`` → ``ListenAddress``; raises
    ``InvalidListenAddress``. The one parser of listen addresses: config validates with it and
    ``app.py`` binds what it returns."""
    if text.startswith("["):
        host, closing, rest = text[1:].partition("]")
        if not closing:
            raise InvalidListenAddress(text, '"[" without a closing "]"')
        if not rest.startswith(":"):
            raise InvalidListenAddress(text, '":port" must follow "]"')
        port = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidListenAddress(
                text, f"{render(host)} in brackets is not an IPv6 address"
            ) from None
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise InvalidListenAddress(text, 'no ":port"')
        if ":" in host:
            raise InvalidListenAddress(text, 'IPv6 hosts go in brackets ("[::1]:9410")')
        if host and not _HOST_NAME.fullmatch(host):
            raise InvalidListenAddress(
                text, f"host {render(host)} is not an IPv4 address or host name"
            )
    # isdigit() alone would take "²" and "٣"; int() alone would take "+1", " 1" and "1_0".
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise InvalidListenAddress(
            text, f"port {render(port)} is not a whole number from 0 to 65535"
        )
    return ListenAddress(host=host, port=int(port))
