"""The TOML config file: ``version = 1``, then the sections of ``Settings`` and the
``[limits.namespaces.<namespace>]`` tables (``config.example.toml`` documents every key).

Owns reading the file (bounded, regular files only) and refusing what it must not hold: an
unknown or missing version, unknown sections and keys (each with the name it most likely
meant), a section that is not a table, a namespace table whose default is above its maximum.
Must not read the environment or flags (``overlay``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, Final

from gpuguard.adapters.manifest import InputError, read_bounded
from gpuguard.config.checks import DEFAULT_ABOVE_MAX, default_above_max
from gpuguard.config.collected import Collected, refused
from gpuguard.config.messages import closest, render, toml_key, unknown_name
from gpuguard.config.parsers import DNS_LABEL, NOT_A_NAMESPACE, Invalid
from gpuguard.config.settings import SECTIONS, NamespaceSettings

CONFIG_VERSION: Final = 1

MAX_CONFIG_BYTES = 1 << 20
"""A config file is a few KiB; anything over 1 MiB is the wrong file."""


def read_file(collected: Collected, path: Path) -> None:
    """Everything ``path`` sets, into ``collected``; its problems too."""
    where = str(path)
    try:
        # Bounded and regular files only: /dev/zero or a FIFO as --config exhausted memory
        # or hung.
        data = tomllib.loads(read_bounded(path, max_bytes=MAX_CONFIG_BYTES, what="config file"))
    except InputError as error:
        collected.problems.append(str(error))
        return
    except tomllib.TOMLDecodeError as error:
        collected.problems.append(f"{where}: TOML syntax error: {error}")
        return
    version = data.pop("version", None)
    if version is None:
        collected.problems.append(
            f"{where}: missing version = {CONFIG_VERSION} (required before any section)"
        )
    elif type(version) is not int or version != CONFIG_VERSION:
        collected.problems.append(
            f"{where}: version = {render(version)}: unsupported, this gpuguard reads "
            f"version = {CONFIG_VERSION}"
        )
    for section, table in data.items():
        if section not in SECTIONS:
            allowed = "allowed: version and the sections " + ", ".join(f"[{s}]" for s in SECTIONS)
            collected.problems.append(_unknown_key(where, "", section, SECTIONS, allowed))
        elif not isinstance(table, dict):
            collected.problems.append(
                f"{where}: {section} = {render(table)}: must be a table [{section}]"
            )
        else:
            _read_section(collected, where, section, table)


def _read_section(collected: Collected, where: str, section: str, table: dict[str, Any]) -> None:
    known = [f.name for f in dataclasses.fields(SECTIONS[section])]
    for key, raw in table.items():
        if key not in known:
            allowed = f"allowed in [{section}]: " + ", ".join(known)
            collected.problems.append(_unknown_key(where, section, key, known, allowed))
        elif (section, key) == ("limits", "namespaces"):
            _read_namespaces(collected, where, raw)
        else:
            collected.record(section, key, raw, text=False, origin=where)


def _read_namespaces(collected: Collected, where: str, raw: object) -> None:
    if not isinstance(raw, dict):
        collected.problems.append(
            f"{where}: limits.namespaces = {render(raw)}: must be tables "
            "[limits.namespaces.<namespace>]"
        )
        return
    for namespace, table in raw.items():
        prefix = f"limits.namespaces.{toml_key(namespace)}"
        if not DNS_LABEL.fullmatch(namespace):
            collected.problems.append(
                f"{where}: [{prefix}]: " + NOT_A_NAMESPACE.format(name=repr(namespace))
            )
        elif not isinstance(table, dict):
            collected.problems.append(
                f"{where}: {prefix} = {render(table)}: must be a table [{prefix}]"
            )
        else:
            settings = _namespace_settings(collected, where, prefix, table)
            collected.namespaces[namespace] = settings
            if default_above_max(settings):
                collected.problems.append(f"{where}: " + DEFAULT_ABOVE_MAX.format(table=prefix))


def _namespace_settings(
    collected: Collected, where: str, prefix: str, table: dict[str, Any]
) -> NamespaceSettings:
    known = {f.name: f for f in dataclasses.fields(NamespaceSettings)}
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in known:
            allowed = "allowed: " + ", ".join(known)
            collected.problems.append(_unknown_key(where, prefix, key, known, allowed))
            continue
        try:
            values[key] = known[key].metadata["parse"](raw, False)
        except Invalid as problem:
            collected.problems.append(refused(where, f"{prefix}.{key}", raw, problem))
    return NamespaceSettings(**values)


def _unknown_key(where: str, table: str, key: str, known: Collection[str], allowed: str) -> str:
    """``key`` of ``table`` ("" for the top level, whose keys are sections) is none of ``known``:
    the problem, with the known name it most likely meant."""
    close = closest(key, known)
    if table:
        dotted, meant = f"{table}.{key}", None if close is None else f"{table}.{close}"
    else:
        dotted, meant = key, None if close is None else f"[{close}]"
    return unknown_name(f"{where}: unknown key {dotted}", meant, allowed)
