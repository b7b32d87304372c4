"""``gpuguard check-pod``: lint pod manifests' gpuguard annotation and show the resolved limits.

Owns the ``check-pod`` contract (docs/design.md, CLI outputs): ``{"pods": [...]}``, one entry per
Pod and per pod template of a workload (Deployment, StatefulSet, DaemonSet, ReplicaSet,
ReplicationController, Job, CronJob, PodTemplate) in the files (multi-document YAML, and the items
of ``kind: List``; ``-`` is stdin), each with ``namespace``, ``name``, ``limit_bytes``, ``source``,
``errors`` and ``warnings``, plus ``kind``, ``object`` (``Deployment team-a/web (pod template)``),
``file`` and ``declarations`` (every valid declaration seen — the annotation's and each listed
scheduler's — with its bytes and whether it is the one that bound: each caps, the smallest binds)
and ``container_limits`` (each container's own limit, where KAI's per-container keys declare
one: ``{container, limit_bytes, what, value}``).
A template's entry carries its workload's namespace and name. Exit 0 valid; 1 invalid input: a
pod has errors, a file is not a regular UTF-8 file within the size bound, not valid (or hostile)
YAML, has the wrong shape, or nothing in the files can be checked; 2 usage error (a file that
cannot be opened, an invalid ``--config``, a bad ``--gpu-memory``). Files are read through
``adapters.manifest``, the one reader of user-supplied files. Must not talk to a cluster or read
the environment: the result depends only on the files, ``--config`` and ``--gpu-memory``, so CI
runs are reproducible.

Each Pod and template is translated by ``kubemodel.translate``, as the API server's and the
pods file's pods are, so an annotation means the same here as to the enforcer. Limits resolve
exactly as the enforcer resolves them (``core.limits.resolve_limit``), for a device of
``--gpu-memory`` bytes; without it a percentage cannot be resolved and is an error (and among
several declarations the smallest is then unknown: no limit is shown, never a guess). No device
is named, so a scheduler's pin is not checked: each declaration is shown as it applies on the
GPU it names. The node's time-slicing replicas are unknown here, so no ``replicas`` default
applies.

DRA: the ResourceClaimTemplates and ResourceClaims of all the files are read first
(``kubemodel.dra_templates``), then each pod's entry gets ``dra_shares``: one
``{container, claim, request, memory_bytes, from}`` per share a container uses (the request's
memory rounded up to the 1Mi step; an allocated claim's ``consumedCapacity``; ``memory_bytes``
null for a whole GPU without ``--gpu-memory``). Where ``limits.sources`` lists ``dra`` the
pod's distinct shares (one per claim and request, however many containers use it) become its
``dra`` declaration, summed by ``core.limits`` like the enforcer's (no device is known here, so
all of them); otherwise they are only shown, with a warning. A claim or template the pod names
that is not in the files: a warning naming it, and no ``dra`` declaration (never a partial sum).
A request is a share only where the enforcer would hold the pod to it (``dra.share_refusal``, the
one rule for both): NVIDIA's ``gpu.nvidia.com`` DeviceClass, or a result of that driver; any
other is named in a warning and left out.

A pod bounded by nothing (no limit, no error, no declaration; not exempt by name, and no DRA
share unknown here) gets a warning saying so with the fix: ``bound_by="none"`` on its node.
Each entry also says what would bound the pod (``bound_by``: ``namespace_max`` where the
namespace maximum capped the source's limit) and, for a percentage without ``--gpu-memory``, the
value as written (``unresolved_limit``). A declaration ``limits.sources`` does not list, and a
namespace the admin keeps in audit mode, are warned about: else the pod reads "ok" and is not
what gpuguard enforces. With nothing checked, no table is printed: only the reason, on stderr.

The table, each pod's lines and every message on stderr escape what they show
(``core.text.printable``): names, annotations, claim names and file names are their authors',
and a control character in one (``ESC [2K``, ``\\r``, ``U+202E``, a newline) must not redraw
the admin's terminal. The JSON is exact.

Size: over 600 lines, on purpose: one command's whole contract, from the files to its JSON and
exit code (reading and DRA translation live in the adapters it names).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from gpuguard.adapters.manifest import (
    MANIFEST_MAX_BYTES,
    TEMPLATE_PATHS,
    Found,
    InputError,
    OtherObject,
    PodManifest,
    ShapeProblem,
    load_yaml_documents,
    pod_manifests,
    read_bounded,
    shorten,
)
from gpuguard.commands.exit_codes import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from gpuguard.commands.explain import (
    container_limit_lines,
    container_limits_json,
    declarations_json,
)
from gpuguard.config import Settings, load_settings
from gpuguard.core.limits import bound_by, exempt_label_text, is_exempt, resolve_limit
from gpuguard.core.model import (
    GPUGUARD_SOURCE,
    LIMIT_ANNOTATION,
    BoundBy,
    Declaration,
    DraShare,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Mode,
    Pod,
    PodUid,
    ResolvedLimit,
)
from gpuguard.core.text import display_width, pad, printable
from gpuguard.core.units import format_bytes
from gpuguard.errors import ConfigError, GpuguardError
from gpuguard.kubemodel.dra_templates import (
    CLAIM,
    TEMPLATE,
    ClaimKey,
    ClaimObject,
    PodShares,
    claim_object,
    pod_shares,
)
from gpuguard.kubemodel.quantity import InvalidQuantity, parse_quantity_bytes
from gpuguard.kubemodel.translate import pod_from_manifest

_NEEDS_SIZE = "needs the device's memory size"
_READS = (
    "check-pod reads Pods and the pod templates of "
    + ", ".join(sorted(TEMPLATE_PATHS))
    + f", and {CLAIM}s and {TEMPLATE}s for the pods' DRA shares"
)


class ManifestError(GpuguardError):
    """A manifest file that cannot be checked. ``exit_code``: 2 cannot be opened, 1 invalid."""

    def __init__(self, message: str, *, exit_code: int) -> None:
        self.exit_code = exit_code
        super().__init__(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class _FileResult:
    pods: list[dict[str, Any]]
    skipped: list[OtherObject]
    """Objects that are not Pods nor pod templates: summarised on stderr, once for all files."""
    problems: list[str]
    """Shapes that could not be checked (``items`` an int): each makes the check fail."""


def check_pods(
    paths: Sequence[str | Path],
    *,
    settings_or_policy: Settings | LimitPolicy,
    gpu_memory_bytes: int | None,
) -> dict[str, Any]:
    """``{"pods": [...]}`` for every Pod and pod template in ``paths`` (docs/design.md, CLI
    outputs).

    Raises ``ManifestError`` for a file that cannot be read, parsed or walked.
    """
    policy = _policy(settings_or_policy)
    loaded = [_load_file(path) for path in paths]
    claims = _claims(loaded)
    pods: list[dict[str, Any]] = []
    for file in loaded:
        result = _check_file(file, policy, gpu_memory_bytes, claims)
        if result.problems:
            raise ManifestError(result.problems[0], exit_code=EXIT_INVALID)
        pods.extend(result.pods)
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
            _say(f"--gpu-memory: {error}", err)
            return EXIT_USAGE
    try:
        # No --config: the built-in defaults (exempt namespaces, no default limit).
        settings = load_settings(config_path=config_path, environ={}) if config_path else Settings()
    except ConfigError as error:
        _say(f"--config: {error}", err, line_breaks=True)
        return EXIT_USAGE
    policy = settings.limit_policy()

    pods: list[dict[str, Any]] = []
    skipped: list[OtherObject] = []
    loaded, code = _load_files(files, err)
    if code == EXIT_USAGE:
        return EXIT_USAGE
    # Claims and templates first: a pod may name one that a later file holds.
    claims = _claims(loaded)
    for file in loaded:
        result = _check_file(file, policy, gpu_memory_bytes, claims)
        pods.extend(result.pods)
        skipped.extend(result.skipped)
        for problem in result.problems:
            _say(problem, err)
            code = EXIT_INVALID
    if skipped:
        _say(skipped_summary(skipped), err)
    if any(pod["errors"] for pod in pods):
        code = EXIT_INVALID
    if not pods:
        # A linter given nothing it can check has not checked anything: a failed check.
        _say("no Pod or pod template found in the given files: nothing to check", err)
        code = EXIT_INVALID
    if as_json:
        json.dump({"pods": pods}, stdout, indent=2)
        stdout.write("\n")
    elif pods:
        # No empty table and "0 pod(s) checked" above the reason on stderr: nothing was checked.
        _print_table(pods, stdout)
    return code


# ---------------------------------------------------------------------------------------------


def _say(message: str, err: TextIO, *, line_breaks: bool = False) -> None:
    """One message on stderr, escaped (``core.text.printable``): it names files, objects and
    values the manifests' authors chose, so a newline in them is shown as ``\\n`` too.
    ``line_breaks``: the message's own lines (an invalid ``--config``'s list of problems, each
    of which quotes its values escaped) stay lines."""
    print(printable(f"gpuguard check-pod: {message}", line_breaks=line_breaks), file=err)


def _policy(settings_or_policy: Settings | LimitPolicy) -> LimitPolicy:
    if isinstance(settings_or_policy, Settings):
        return settings_or_policy.limit_policy()
    return settings_or_policy


@dataclass(frozen=True, slots=True, kw_only=True)
class _LoadedFile:
    name: str
    found: list[Found]
    """Every object of the file, in order."""


def _load_files(files: Sequence[str | Path], err: TextIO) -> tuple[list[_LoadedFile], int]:
    """The files that could be read, and ``EXIT_INVALID`` if any could not (each said on
    ``err``); ``EXIT_USAGE`` at the first that cannot be opened."""
    loaded: list[_LoadedFile] = []
    code = EXIT_OK
    for path in files:
        try:
            loaded.append(_load_file(path))
        except ManifestError as error:
            _say(str(error), err)
            if error.exit_code == EXIT_USAGE:
                return loaded, EXIT_USAGE
            code = EXIT_INVALID
    return loaded, code


def _load_file(path: str | Path) -> _LoadedFile:
    name = "<stdin>" if str(path) == "-" else str(path)
    try:
        text = read_bounded(path, max_bytes=MANIFEST_MAX_BYTES, what="manifest")
        documents = load_yaml_documents(text, where=name)
    except InputError as error:
        code = EXIT_USAGE if error.unopenable else EXIT_INVALID
        raise ManifestError(str(error), exit_code=code) from None
    found = [
        item
        for number, document in enumerate(documents, start=1)
        for item in pod_manifests(document, where=f"{name}: document {number}")
    ]
    return _LoadedFile(name=name, found=found)


def _claims(files: Sequence[_LoadedFile]) -> dict[ClaimKey, ClaimObject]:
    """The ResourceClaims and ResourceClaimTemplates of all files (the first of a name wins)."""
    claims: dict[ClaimKey, ClaimObject] = {}
    for file in files:
        for found in file.found:
            if isinstance(found, OtherObject) and found.kind in (CLAIM, TEMPLATE):
                claim = claim_object(found.object, where=found.where)
                if claim is not None:
                    claims.setdefault((claim.kind, claim.namespace, claim.name), claim)
    return claims


def _check_file(
    file: _LoadedFile,
    policy: LimitPolicy,
    gpu_memory_bytes: int | None,
    claims: Mapping[ClaimKey, ClaimObject],
) -> _FileResult:
    result = _FileResult(pods=[], skipped=[], problems=[])
    for found in file.found:
        if isinstance(found, PodManifest):
            result.pods.append(_check_pod(found, file.name, policy, gpu_memory_bytes, claims))
        elif isinstance(found, ShapeProblem):
            result.problems.append(found.message)
        elif found.kind not in (CLAIM, TEMPLATE):
            result.skipped.append(found)
    return result


SHOWN_WITHOUT_KIND = 3
"""Objects without a kind named by where they are (likely a mistake); the rest only counted."""


def skipped_summary(skipped: Sequence[OtherObject]) -> str:
    """One line for every object that is neither a Pod nor a pod template, counted per kind
    (most first): ``helm template … | gpuguard check-pod -`` holds dozens of Services,
    ConfigMaps and RBAC objects, and a line each buried the findings. Objects without a kind
    (not a Kubernetes object: probably a mistake) are named by where they are."""
    kinds = Counter(other.kind for other in skipped if other.kind is not None)
    parts = [
        f"{count} {kind}" for kind, count in sorted(kinds.items(), key=lambda i: (-i[1], i[0]))
    ]
    kindless = [other.where for other in skipped if other.kind is None]
    if kindless:
        shown = ", ".join(kindless[:SHOWN_WITHOUT_KIND])
        more = (
            f", … {len(kindless) - SHOWN_WITHOUT_KIND} more"
            if len(kindless) > SHOWN_WITHOUT_KIND
            else ""
        )
        parts.append(f"{len(kindless)} without a kind ({shown}{more})")
    what = (
        "object that is neither a Pod nor a pod template"
        if len(skipped) == 1
        else "objects that are neither Pods nor pod templates"
    )
    return f"skipped {len(skipped)} {what}: {', '.join(parts)} ({_READS})"


def manifest_pod(found: PodManifest) -> Pod:
    """The ``Pod`` check-pod judges: translated by ``kubemodel.translate`` as the API
    server's and the pods file's pods are, under the object's identity (a template's pods carry
    their workload's namespace and name, and have no uid yet)."""
    return _pod(found, _identity(found))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Identity:
    """The namespace and name an entry is shown by, and what is wrong with them."""

    namespace: str
    name: str | None
    errors: list[str]
    warnings: list[str]


def _identity(found: PodManifest) -> _Identity:
    """The Pod's identity, or the workload's for a template (its pods are named after it and
    created in its namespace)."""
    errors: list[str] = []
    warnings: list[str] = []
    metadata = found.object.get("metadata")
    if not isinstance(metadata, Mapping):
        if metadata is None and found.template_path is None:
            errors.append("metadata is missing or not a mapping")
        metadata = {}
    namespace = metadata.get("namespace") or "default"
    if not isinstance(namespace, str):
        errors.append(f"metadata.namespace {shorten(namespace)} is not a string")
        namespace = "default"
    name = metadata.get("name")
    if name is None and isinstance(metadata.get("generateName"), str):
        name = metadata["generateName"]
        warnings.append(f"no metadata.name: shown by generateName {shorten(name)}")
    elif not isinstance(name, str) or not name:
        errors.append("metadata.name is missing")
        name = None
    return _Identity(namespace=namespace, name=name, errors=errors, warnings=warnings)


def _pod(found: PodManifest, identity: _Identity) -> Pod:
    uid = found.metadata.get("uid") if found.template_path is None else None
    return pod_from_manifest(
        found.pod,
        uid=PodUid(uid if isinstance(uid, str) else ""),
        namespace=identity.namespace,
        name=identity.name or "",
    )


def _check_pod(
    found: PodManifest,
    file: str,
    policy: LimitPolicy,
    gpu_memory_bytes: int | None,
    claims: Mapping[ClaimKey, ClaimObject],
) -> dict[str, Any]:
    identity = _identity(found)
    errors = [*found.problems, *identity.errors]
    warnings = list(identity.warnings)
    pod = _pod(found, identity)
    shares = pod_shares(found.pod, namespace=identity.namespace, claims=claims)
    errors.extend(shares.problems)
    warnings.extend(shares.warnings)
    declaration = _dra_declaration(shares, policy, warnings)
    warnings.extend(_above_the_device(shares, gpu_memory_bytes))
    if declaration is not None:
        pod = replace(pod, declared={**pod.declared, LimitSource.DRA: declaration})
    annotations = _raw_annotations(found.pod)
    if found.template_path is not None:
        errors.extend(_misplaced_annotation(found, found.metadata, annotations))
    resolved = resolve_limit(
        pod=pod, device_total_bytes=gpu_memory_bytes, policy=policy, replicas=None
    )
    errors.extend(
        f"{e} (pass --gpu-memory, the device's total memory)" if _NEEDS_SIZE in e else e
        for e in resolved.errors
    )
    warnings.extend(resolved.warnings)
    # No cluster here: a namespace's labels are unknown, so only the names can tell.
    exempt = is_exempt(pod.namespace, policy, None)
    if exempt:
        warnings.append(
            f"namespace {pod.namespace} is exempt by the admin's config: gpuguard reports this "
            "pod's GPU memory but never acts on it"
        )
    elif exempt is None:
        warnings.append(
            f"namespace {pod.namespace} is exempt if it carries the label "
            f"{exempt_label_text(policy)} (limits.exempt_namespace_label), which check-pod "
            "cannot read: then gpuguard reports this pod's GPU memory but never acts on it"
        )
    if not exempt and not shares.missing:
        warnings.extend(_unbounded(resolved, pod.namespace, policy))
    warnings.extend(_unlisted_sources(pod, policy))
    warnings.extend(_audit_namespace(pod.namespace, policy))
    if LIMIT_ANNOTATION in annotations:
        warnings.extend(_no_gpu(found, pod, shares))
    return {
        "namespace": pod.namespace,
        "name": identity.name,
        "limit_bytes": resolved.limit_bytes,
        "source": None if resolved.source is None else resolved.source.value,
        "errors": errors,
        "warnings": warnings,
        "kind": found.kind,
        "object": found.description,
        "file": file,
        "where": found.where,
        "declarations": declarations_json(resolved),
        "container_limits": container_limits_json(resolved),
        "dra_shares": _shares_json(shares, gpu_memory_bytes),
        "bound_by": bound_by(resolved, exempt=exempt is True).value,
        "unresolved_limit": _unresolved_limit(resolved, pod.namespace, policy),
    }


def _no_gpu(found: PodManifest, pod: Pod, shares: PodShares) -> list[str]:
    """An annotated pod that gets no GPU: no GPU resource, no DRA claim, and no scheduler's
    declaration (KAI gives fractions by annotation alone)."""
    if shares.uses or shares.missing or pod.declared or _requests_a_gpu(found.pod):
        return []
    return [
        "no container requests a GPU (an nvidia.com/*, aliyun.com/gpu-* or volcano.sh/vgpu-* "
        "resource, or a DRA claim) and no scheduler declares one for it (KAI's gpu-fraction or "
        "gpu-memory): the limit has no effect"
    ]


def _unlisted_sources(pod: Pod, policy: LimitPolicy) -> list[str]:
    """A declaration gpuguard would not read: its source is not in ``limits.sources`` (DRA
    shares warn where they are read, ``_dra_declaration``)."""
    warnings = []
    if LIMIT_ANNOTATION in pod.annotations and GPUGUARD_SOURCE not in policy.sources:
        warnings.append(
            f"limits.sources does not list {GPUGUARD_SOURCE}: gpuguard would not enforce the "
            f'annotation {LIMIT_ANNOTATION} (add "{GPUGUARD_SOURCE}" to limits.sources in the '
            "config)"
        )
    for source, declaration in sorted(pod.declared.items()):
        if source is LimitSource.DRA or source.value in policy.sources:
            continue
        warnings.append(
            f"limits.sources does not list {source}: gpuguard would not enforce this "
            f'declaration ({declaration.where}) (add "{source}" to limits.sources in the config)'
        )
    return warnings


def _audit_namespace(namespace: str, policy: LimitPolicy) -> list[str]:
    """The admin kept the namespace in audit mode: its pods are never stopped."""
    namespace_policy = policy.namespaces.get(namespace)
    if namespace_policy is None or namespace_policy.mode is not Mode.AUDIT:
        return []
    return [
        f"namespace {namespace} is in audit mode ([limits.namespaces.{namespace}] mode = "
        '"audit"): gpuguard logs what it would stop in this pod but never stops it'
    ]


def _unresolved_limit(resolved: ResolvedLimit, namespace: str, policy: LimitPolicy) -> str | None:
    """The limit as written where it binds but cannot be resolved to bytes here (a percentage
    without ``--gpu-memory``): ``25%``; ``None`` otherwise."""
    if resolved.limit_bytes is not None or resolved.source is None:
        return None
    if resolved.source in (LimitSource.NAMESPACE_DEFAULT, LimitSource.DEFAULT):
        namespace_policy = policy.namespaces.get(namespace)
        value: LimitValue | None = policy.cluster_default
        if resolved.source is LimitSource.NAMESPACE_DEFAULT:
            value = None if namespace_policy is None else namespace_policy.default_limit
        if value is not None and value.percent is not None and value.limit_bytes is None:
            return f"{value.percent:g}%"
        return None
    for declared in resolved.declarations:
        if (
            declared.source is resolved.source
            and declared.limit_bytes is None
            and declared.unresolved is None
            and declared.assigned
        ):
            return declared.value
    return None


def _unbounded(resolved: ResolvedLimit, namespace: str, policy: LimitPolicy) -> list[str]:
    """The warning that nothing would bound the pod (``bound_by="none"`` in
    ``gpuguard_gpu_memory_bound_bytes``): no limit, no error and no declaration at all (an
    invalid or unresolvable one is an error already; one above the device already warns)."""
    if resolved.limit_bytes is not None or resolved.errors or resolved.declarations:
        return []
    replicas = (
        "; on a node that time-slices its GPUs, limits.replicas_default gives it a share of "
        "the device"
        if policy.replicas_default
        else ""
    )
    return [
        "nothing would bound this pod's GPU memory on this node: no "
        f"{LIMIT_ANNOTATION} annotation, no default (limits.default or a default for "
        f"namespace {namespace}) and no declaration of a limit source in limits.sources, so "
        f"gpuguard would report its memory but never stop it{replicas}. Set the annotation "
        "on the pod, limits.default (the chart's value config.limits.default), or default in "
        f"[limits.namespaces.{namespace}]"
    ]


def _shares_json(shares: PodShares, gpu_memory_bytes: int | None) -> list[dict[str, Any]]:
    """``dra_shares`` of check-pod's JSON: each container's claim share (a whole device: the
    device's memory when ``--gpu-memory`` gives it)."""
    return [
        {
            "container": use.container,
            "claim": use.claim,
            "request": use.share.request,
            "memory_bytes": (
                gpu_memory_bytes if use.share.memory_bytes is None else use.share.memory_bytes
            ),
            "from": use.source.description,
        }
        for use in shares.uses
    ]


def _above_the_device(shares: PodShares, gpu_memory_bytes: int | None) -> list[str]:
    """Requests the scheduler can never allocate: the driver's maximum is the whole GPU."""
    if gpu_memory_bytes is None:
        return []
    over = {
        f"{use.source.description} request {use.share.request}": use.share.memory_bytes
        for use in shares.uses
        if use.share.memory_bytes is not None and use.share.memory_bytes > gpu_memory_bytes
    }
    device = format_bytes(gpu_memory_bytes)
    return [
        f"{what} asks for {format_bytes(size)}, more than the device's {device}: the scheduler "
        "cannot allocate it (the pod stays Pending)"
        for what, size in over.items()
    ]


def _dra_declaration(
    shares: PodShares, policy: LimitPolicy, warnings: list[str]
) -> Declaration | None:
    """The pod's ``dra`` declaration: one share per (claim, request) its containers use, none
    while any of them is unknown here or ``limits.sources`` does not list ``dra``."""
    warnings.extend(
        f"{missing} is not in the files: its share is unknown here, so no dra limit is shown"
        for missing in shares.missing
    )
    if not shares.uses or shares.missing or shares.problems:
        return None
    if LimitSource.DRA.value not in policy.sources:
        warnings.append(
            "limits.sources does not list dra: gpuguard would not enforce these DRA shares "
            '(add "dra" to limits.sources in the config)'
        )
        return None
    distinct: dict[tuple[str, str, str, str, str], DraShare] = {}
    for use in shares.uses:
        claim, share = use.source, use.share
        key = (claim.description, share.request, share.driver, share.pool, share.device)
        distinct[key] = DraShare(
            claim_namespace=claim.namespace,
            claim_name=claim.name,
            request=share.request,
            driver=share.driver,
            pool=share.pool,
            device=share.device,
            share_id=None,
            memory_bytes=share.memory_bytes,
            uuid=None,
        )
    where = ", ".join(dict.fromkeys(use.source.description for use in shares.uses))
    return Declaration(where=where, shares=tuple(distinct.values()))


def _raw_annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The annotations as written, values of any type (the Pod keeps the string ones only)."""
    metadata = pod.get("metadata")
    raw = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return {str(k): v for k, v in raw.items()} if isinstance(raw, Mapping) else {}


def _misplaced_annotation(
    found: PodManifest, metadata: Mapping[str, Any], template_annotations: Mapping[str, Any]
) -> list[str]:
    """The annotation on the workload itself: its pods never see it (they copy the template)."""
    own = metadata.get("annotations")
    if (
        isinstance(own, Mapping)
        and LIMIT_ANNOTATION in own
        and LIMIT_ANNOTATION not in template_annotations
    ):
        return [
            f"{LIMIT_ANNOTATION} is on the {found.kind}'s own metadata, which its pods do not "
            f"inherit: move it to {found.template_path}.metadata.annotations"
        ]
    return []


_GPU_RESOURCES = ("nvidia.com/", "aliyun.com/gpu", "volcano.sh/vgpu")
"""Extended resources that get a container a GPU: NVIDIA's device plugin (and HAMi's), gpushare's
and Volcano's. KAI's fractions are annotations (a declaration)."""


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
                    str(key).startswith(_GPU_RESOURCES) for key in amounts
                ):
                    return True
    return False


def _print_table(pods: list[dict[str, Any]], out: TextIO) -> None:
    """The human table, then each pod's declarations, shares, errors and warnings, then the
    count. Every cell and line is escaped (``core.text.printable``): names, annotations and the
    file's own name are the manifests' authors', and a control character in one could redraw the
    table (a fake ``ok`` row, an error line erased). Columns are padded by the cells the escaped
    text takes on a terminal (``core.text.pad``)."""
    headers = ("KIND", "NAMESPACE", "NAME", "LIMIT", "SOURCE", "STATUS")
    rows = [
        tuple(
            printable(str(cell))
            for cell in (
                pod["kind"],
                pod["namespace"],
                pod["name"] or "<no name>",
                _limit_cell(pod),
                "namespace-max"
                if pod["bound_by"] == BoundBy.NAMESPACE_MAX
                else pod["source"] or "-",
                _status(pod),
            )
        )
        for pod in pods
    ]
    widths = [
        max(display_width(cell) for cell in column) for column in zip(headers, *rows, strict=True)
    ]
    for row in (headers, *rows):
        cells = (pad(cell, width) for cell, width in zip(row, widths, strict=True))
        out.write("  ".join(cells).rstrip() + "\n")
    for pod in pods:
        declared = (
            _declared_lines(pod["declarations"])
            + [f"own limit of {line}" for line in container_limit_lines(pod["container_limits"])]
            + _share_lines(pod["dra_shares"])
        )
        if pod["errors"] or pod["warnings"] or declared:
            out.write(f"\n{printable(pod['where'])}: {printable(pod['object'])}:\n")
            for line in declared:
                out.write(f"  {printable(line)}\n")
            for error in pod["errors"]:
                out.write(f"  error: {printable(error)}\n")
            for warning in pod["warnings"]:
                out.write(f"  warning: {printable(warning)}\n")
    invalid = sum(1 for pod in pods if pod["errors"])
    out.write(f"\n{len(pods)} pod(s) checked, {invalid} with errors\n")


def _limit_cell(pod: Mapping[str, Any]) -> str:
    """The LIMIT column: bytes, the value that needs the device's size, or ``none``."""
    if pod["limit_bytes"] is not None:
        return format_bytes(pod["limit_bytes"])
    if pod["unresolved_limit"] is not None:
        return f"{pod['unresolved_limit']} (size unknown)"
    return "none"


def _declared_lines(declarations: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each declaration seen and the one that bound, where more than gpuguard's own annotation
    was read (a lone annotation is the SOURCE column already)."""
    if not declarations or [d["source"] for d in declarations] == ["annotation"]:
        return []
    lines = []
    for d in declarations:
        size = "size unknown" if d["limit_bytes"] is None else format_bytes(d["limit_bytes"])
        pinned = f", pinned to {', '.join(d['pinned'])}" if d["pinned"] else ""
        bound = " <- binds (the smallest)" if d["bound"] else ""
        lines.append(f"declared: {d['what']} {d['value']} = {size}{pinned}{bound}")
    return lines


def _share_lines(shares: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per DRA share a container uses."""
    return [
        f"dra share: container {s['container']} claim {s['claim']} request {s['request']} = "
        + (
            "the whole GPU (size unknown)"
            if s["memory_bytes"] is None
            else format_bytes(s["memory_bytes"])
        )
        + f" ({s['from']})"
        for s in shares
    ]


def _status(pod: Mapping[str, Any]) -> str:
    parts = []
    if pod["errors"]:
        parts.append(f"{len(pod['errors'])} error(s)")
    if pod["warnings"]:
        parts.append(f"{len(pod['warnings'])} warning(s)")
    return ", ".join(parts) or "ok"
