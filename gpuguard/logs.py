"""Logging setup: structlog, JSON when not on a TTY (or when asked), stdlib bridged.

Owns ``configure()``, called once by the CLI. Modules call ``structlog.get_logger(__name__)``
and never configure anything. Event names are stable snake_case; data goes in keys.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def configure(
    *, level: str = "info", json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger once.

    Args:
        level: Minimum level name (``debug``, ``info``, ``warning``, ``error``).
        json: JSON lines when True, console rendering when False, auto (not a TTY → JSON) if None.
        stream: Where log lines go (default stderr, so stdout stays free for ``--json`` output).
    """
    out = stream if stream is not None else sys.stderr
    as_json = (not out.isatty()) if json is None else json
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.dict_tracebacks
            if as_json
            else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processor=renderer)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
