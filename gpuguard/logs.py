"""Logging setup: structlog, JSON when not on a TTY (or when asked), stdlib bridged.

Owns ``configure()``, called once by the CLI. Modules call ``structlog.get_logger(__name__)``
and never configure anything. Event names are stable snake_case; data goes in keys.

Log lines carry what others wrote (pod and namespace names, annotations, cgroup and file names,
a library's messages): rendered for a terminal, every string is escaped first
(``escape_for_terminal``, through ``core.text.printable``), as every command's human output is;
JSON escapes on its own and carries the exact value.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from gpuguard.core.text import printable

_MULTI_LINE_KEYS = frozenset({"exception", "stack", "stack_info"})
"""Keys whose text is several lines on purpose (a traceback, a stack): their line breaks stay."""


def escape_for_terminal(
    logger: structlog.types.WrappedLogger, method_name: str, event_dict: structlog.types.EventDict
) -> structlog.types.EventDict:
    """Every string key and value of ``event_dict`` as ``printable`` shows it, so that a pod name
    holding ``ESC [2K``, ``\\r`` or ``U+202E`` cannot redraw the console line it is logged in;
    printable text, event names included, is unchanged. Only before the console renderer: it
    prints a string without quotes unless it holds a space, ``=`` or a quote (then as ``repr``,
    where an escape shows its backslash doubled). Other values are shown by ``repr``, which
    escapes the strings inside them."""
    return {
        (printable(key) if isinstance(key, str) else key): _shown(key, value)
        for key, value in event_dict.items()
    }


def _shown(key: object, value: object) -> object:
    if isinstance(value, str):
        return printable(value, line_breaks=key in _MULTI_LINE_KEYS)
    if key == "event":  # shown by str(), not repr(): a foreign message may be any object
        return printable(str(value))
    return value


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
    # What renders a line, after the shared steps: for a terminal, a traceback becomes text
    # (``exception``) before everything is escaped, so a foreign record's too.
    rendering: list[structlog.types.Processor] = (
        [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if as_json
        else [
            structlog.processors.format_exc_info,
            escape_for_terminal,
            structlog.dev.ConsoleRenderer(colors=out.isatty()),
        ]
    )
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *rendering],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # A stdlib record (a library's warning) is rendered as before for JSON; for a terminal it
    # goes through the same escaping as structlog's own lines.
    foreign: list[structlog.types.Processor] = rendering[-1:] if as_json else rendering
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *foreign],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))
