"""``gpuguard check-pod``: lint pod manifests' gpuguard annotation and show the resolved limits.

Owns the DESIGN §5.2 ``check-pod`` contract: ``{"pods": [...]}``, one entry per ``kind: Pod`` in
the files (multi-document YAML, and the items of ``kind: List``), each with ``namespace``,
``name``, ``limit_bytes``, ``source``, ``errors`` and ``warnings``; exit 0 valid, 1 a pod has
errors or a file is not valid YAML, 2 usage error (a file or ``--config`` that cannot be read or
is invalid, a bad ``--gpu-memory``). Must not talk to a cluster or read the environment: the
result depends only on the files, ``--config`` and ``--gpu-memory``, so CI runs are reproducible.

Limits resolve exactly as the enforcer resolves them (``core.limits.resolve_limit``, the same
parser), for a device of ``--gpu-memory`` bytes; without it a percentage cannot be resolved and is
an error. The node's time-slicing replicas are unknown here, so no ``replicas`` default applies.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from gpuguard.adapters.quantity import (
    InvalidQuantity,
    format_bytes,
    parse_limit_annotation,
    parse_quantity_bytes,
)
from gpuguard.config import Settings, load_settings
from gpuguard.core.limits import is_exempt, resolve_limit
from gpuguard.core.model import LIMIT_ANNOTATION, LimitPolicy, Pod, PodUid
from gpuguard.errors import ConfigError, GpuguardError

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2

_NEEDS_SIZE = "needs the device's memory size"
_LIST_KINDS = frozenset({"List", "PodList"})


class ManifestError(GpuguardError):
    """A manifest file that cannot be checked. ``exit_code``: 2 unreadable, 1 not valid YAML."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        self.exit_code = exit_code
        super().__init__(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class _FileResult:
    pods: list[dict[str, Any]]
    notes: list[str]


def check_pods(
    paths: Sequence[str | Path],
    *,
    settings_or_policy: Settings | LimitPolicy,
    gpu_memory_bytes: int | None,
) -> dict[str, Any]:
    """``{"pods": [...]}`` for every Pod in ``paths`` (DESIGN §5.2).

    Raises ``ManifestError`` for a file that cannot be read or parsed.
    """
    policy = _policy(settings_or_policy)
    pods: list[dict[str, Any]] = []
    for path in paths:
        pods.extend(_check_file(Path(path), policy, gpu_memory_bytes).pods)
    return {"pods": pods}


def run_check_pod(
    *,
    files: Sequence[str | Path],
    config_path: str | Path | None,
    gpu_memory: str | None,
    as_json: bool,
    stdout: TextIO,
    stderr: TextIO | None = None,
) -> int:
    """The CLI entry: check ``files``, print JSON or a table, return the exit code."""
    err = sys.stderr if stderr is None else stderr
    gpu_memory_bytes: int | None = None
    if gpu_memory is not None:
        try:
            gpu_memory_bytes = parse_quantity_bytes(gpu_memory)
        except InvalidQuantity as error:
            print(f"gpuguard check-pod: --gpu-memory: {error}", file=err)
            return EXIT_USAGE
    try:
        # No --config: the built-in defaults (exempt namespaces, no default limit).
        settings = load_settings(config_path=config_path, environ={}) if config_path else Settings()
    except ConfigError as error:
        print(f"gpuguard check-pod: --config: {error}", file=err)
        return EXIT_USAGE
    policy = settings.limit_policy()

    pods: list[dict[str, Any]] = []
    code = EXIT_OK
    for path in files:
        try:
            result = _check_file(Path(path), policy, gpu_memory_bytes)
        except ManifestError as error:
            print(f"gpuguard check-pod: {error}", file=err)
            if error.exit_code == EXIT_USAGE:
                return EXIT_USAGE
            code = EXIT_INVALID
            continue
        pods.extend(result.pods)
        for note in result.notes:
            print(f"gpuguard check-pod: {note}", file=err)
    if any(pod["errors"] for pod in pods):
        code = EXIT_INVALID
    if not pods:
        print("gpuguard check-pod: no Pod found in the given files", file=err)
    if as_json:
        json.dump({"pods": pods}, stdout, indent=2)
        stdout.write("\n")
    else:
        _print_table(pods, stdout)
    return code


# ---------------------------------------------------------------------------------------------


def _policy(settings_or_policy: Settings | LimitPolicy) -> LimitPolicy:
    if isinstance(settings_or_policy, Settings):
        return settings_or_policy.limit_policy()
    return settings_or_policy


def _check_file(path: Path, policy: LimitPolicy, gpu_memory_bytes: int | None) -> _FileResult:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ManifestError(
            f"{path}: cannot read: {error.strerror or error}", exit_code=EXIT_USAGE
        ) from None
    except UnicodeDecodeError as error:
        raise ManifestError(
            f"{path}: not UTF-8 text: {error.reason}", exit_code=EXIT_INVALID
        ) from None
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as error:
        where = ""
        mark = getattr(error, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(error, "problem", None) or str(error)
        raise ManifestError(
            f"{path}: not valid YAML{where}: {problem}", exit_code=EXIT_INVALID
        ) from None

    pods: list[dict[str, Any]] = []
    notes: list[str] = []
    for number, document in enumerate(documents, start=1):
        for item, where in _objects(document, f"{path}: document {number}"):
            kind = item.get("kind")
            if kind == "Pod":
                pods.append(_check_pod(item, policy, gpu_memory_bytes))
            else:
                notes.append(
                    f"{where} is {'a ' + str(kind) if kind else 'not a Kubernetes object'}, "
                    "not a Pod: skipped (check-pod reads kind: Pod)"
                )
    return _FileResult(pods=pods, notes=notes)


def _objects(document: object, where: str) -> Iterator[tuple[Mapping[str, Any], str]]:
    """The objects in one YAML document: itself, or the items of a ``List``."""
    if document is None:
        return
    if not isinstance(document, Mapping):
        yield {}, where
        return
    if document.get("kind") in _LIST_KINDS and isinstance(document.get("items"), list):
        for index, item in enumerate(document["items"]):
            yield (item if isinstance(item, Mapping) else {}), f"{where} item {index}"
        return
    yield document, where


def _check_pod(
    manifest: Mapping[str, Any], policy: LimitPolicy, gpu_memory_bytes: int | None
) -> dict[str, Any]:
    errors: list[str] = []
    warnings: list[str] = []
    metadata = manifest.get("metadata")
    if not isinstance(metadata, Mapping):
        metadata = {}
        errors.append("metadata is missing or not a mapping")
    namespace = metadata.get("namespace") or "default"
    if not isinstance(namespace, str):
        errors.append(f"metadata.namespace {namespace!r} is not a string")
        namespace = str(namespace)
    name = metadata.get("name")
    if name is None and isinstance(metadata.get("generateName"), str):
        name = metadata["generateName"]
        warnings.append(f"no metadata.name: shown by generateName {name!r}")
    elif not isinstance(name, str) or not name:
        errors.append("metadata.name is missing")
        name = None

    raw_annotations = metadata.get("annotations") or {}
    if not isinstance(raw_annotations, Mapping):
        errors.append("metadata.annotations is not a mapping")
        raw_annotations = {}
    annotations = {str(k): v for k, v in raw_annotations.items()}
    limit, annotation_error = parse_limit_annotation(annotations)
    pod = Pod(
        uid=PodUid(""),
        namespace=namespace,
        name=name or "",
        annotations={k: v for k, v in annotations.items() if isinstance(v, str)},
        annotation_limit=limit,
        annotation_error=annotation_error,
    )
    resolved = resolve_limit(
        pod=pod, device_total_bytes=gpu_memory_bytes, policy=policy, replicas=None
    )
    errors.extend(
        f"{e} (pass --gpu-memory, the device's total memory)" if _NEEDS_SIZE in e else e
        for e in resolved.errors
    )
    warnings.extend(resolved.warnings)
    if is_exempt(namespace, policy):
        warnings.append(
            f"namespace {namespace} is exempt by the admin's config: gpuguard reports this pod's "
            "GPU memory but never acts on it"
        )
    if LIMIT_ANNOTATION in annotations and not _requests_a_gpu(manifest):
        warnings.append(
            "no container requests an nvidia.com/* GPU resource: the limit has no effect"
        )
    return {
        "namespace": namespace,
        "name": name,
        "limit_bytes": resolved.limit_bytes,
        "source": None if resolved.source is None else resolved.source.value,
        "errors": errors,
        "warnings": warnings,
    }


def _requests_a_gpu(manifest: Mapping[str, Any]) -> bool:
    spec = manifest.get("spec")
    if not isinstance(spec, Mapping):
        return False
    for group in ("containers", "initContainers"):
        containers = spec.get(group)
        if not isinstance(containers, list):
            continue
        for container in containers:
            resources = container.get("resources") if isinstance(container, Mapping) else None
            if not isinstance(resources, Mapping):
                continue
            for kind in ("limits", "requests"):
                amounts = resources.get(kind)
                if isinstance(amounts, Mapping) and any(
                    str(key).startswith("nvidia.com/") for key in amounts
                ):
                    return True
    return False


def _print_table(pods: list[dict[str, Any]], out: TextIO) -> None:
    headers = ("NAMESPACE", "NAME", "LIMIT", "SOURCE", "STATUS")
    rows = [
        (
            pod["namespace"],
            pod["name"] or "<no name>",
            "none" if pod["limit_bytes"] is None else format_bytes(pod["limit_bytes"]),
            pod["source"] or "-",
            _status(pod),
        )
        for pod in pods
    ]
    widths = [
        max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)
    ]
    for row in (headers, *rows):
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")
    for pod in pods:
        if pod["errors"] or pod["warnings"]:
            out.write(f"\n{pod['namespace']}/{pod['name'] or '<no name>'}:\n")
            for error in pod["errors"]:
                out.write(f"  error: {error}\n")
            for warning in pod["warnings"]:
                out.write(f"  warning: {warning}\n")
    invalid = sum(1 for pod in pods if pod["errors"])
    out.write(f"\n{len(pods)} pod(s) checked, {invalid} with errors\n")


def _status(pod: Mapping[str, Any]) -> str:
    parts = []
    if pod["errors"]:
        parts.append(f"{len(pod['errors'])} error(s)")
    if pod["warnings"]:
        parts.append(f"{len(pod['warnings'])} warning(s)")
    return ", ".join(parts) or "ok"
