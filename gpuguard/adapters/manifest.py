"""User-supplied files: bounded reads, bounded YAML, and the Pods and pod templates in a manifest.

Owns the one way gpuguard reads a file a user points it at (``check-pod`` manifests, the
``--pods-file``, the ``--config`` TOML): ``read_bounded`` reads regular files only (or stdin for
``-``), never more than a bound, and decodes UTF-8 with the byte offset of any bad byte.
``load_yaml_documents`` loads YAML safely after a scan of its event stream (iterative, so it
cannot recurse) has refused documents nested too deep or whose aliases expand too far, the
"billion laughs" and bracket bombs. ``pod_manifests`` walks one loaded document and yields every
Pod, ``List`` item and workload pod template, and reports a wrong shape as a value naming where,
never as an exception.

Every failure is one ``InputError`` whose message is one line naming the file; no message embeds
more than a shortened form of a value, and the file's name (a repository's file names are their
authors') and what YAML says of the text are escaped (``core.text.printable``): a message holds
no control character, wherever it is shown. Must not interpret pods (``kubemodel.translate`` and
``commands.check_pod`` do), log, or talk to a cluster.
"""

from __future__ import annotations

import os
import reprlib
import stat
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import yaml
from yaml.constructor import ConstructorError, SafeConstructor

from gpuguard.core.text import printable
from gpuguard.core.units import format_bytes
from gpuguard.errors import GpuguardError

try:  # libyaml: about ten times faster; the pure-Python loader builds the same objects.
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover — PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

MANIFEST_MAX_BYTES = 16 * 1024 * 1024
"""Largest manifest or pods file read (16 MiB). One Kubernetes object is at most 1.5 MiB (etcd's
request limit), so this is room for hundreds; loading it takes ~10 s on one core with libyaml."""

MAX_DEPTH = 64
"""Deepest nesting of a YAML document: a Pod nests ~12 levels, a CRD schema ~30. Deeper is a
bracket bomb (the pure-Python composer recurses once per level)."""

MAX_ALIAS_NODES = 10_000
"""Most nodes that aliases may add to one document once expanded. PyYAML shares an alias's
object rather than copying it, but anything that walks or prints the result (a ``repr`` in an
error message, ``json.dumps``) pays the full expansion: 1 KB of nested aliases is 10⁹ nodes."""

MAX_NUMBER_CHARS = 100
"""Longest scalar converted to an int or float. ``int()`` of a long sexagesimal (``1:0:0:…``) is
quadratic and of more than 4300 decimal digits raises; no Kubernetes number is this long."""

_READ_CHUNK = 1 << 20
_STDIN_NAME = "<stdin>"

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlong = 40
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 4
_short.maxlevel = 2


def shorten(value: object) -> str:
    """``repr(value)``, cut to a few dozen characters: safe for any value in a message."""
    return _short.repr(value)


class InputError(GpuguardError):
    """A user-supplied file that cannot be used: unreadable, not a regular file, too large, not
    UTF-8, binary, invalid or hostile YAML. ``str()`` is one line starting with the file's name.

    ``unopenable`` is true when the path itself could not be opened (missing, no permission): a
    command may call that a usage error, and everything else invalid input.
    """

    def __init__(self, message: str, *, unopenable: bool = False) -> None:
        self.unopenable = unopenable
        super().__init__(message)


# ---------------------------------------------------------------------------------------------
# Reading


def read_bounded(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    what: str,
    stdin: IO[bytes] | None = None,
) -> str:
    """The text of the regular file ``path`` (``-``: stdin), at most ``max_bytes`` bytes.

    ``what`` names the file's role in messages (``"manifest"``, ``"pods file"``,
    ``"config file"``). Refuses FIFOs, devices, directories and sockets without opening them
    (a FIFO would block, ``/dev/zero`` never ends), a file larger than ``max_bytes`` by its size
    or while reading it (``/proc`` files report size 0), bytes that are not UTF-8 and a NUL byte
    (binary). Raises ``InputError``. ``stdin`` (default ``sys.stdin.buffer``) is for tests.
    """
    path = os.fspath(path)
    if path == "-":
        return _decode(_read_stdin(stdin, max_bytes=max_bytes, what=what), _STDIN_NAME, what)
    name = printable(path)  # the file's name as messages show it
    try:
        # Look before opening: opening a FIFO or a device can block or act (a watchdog).
        _refuse_special(name, os.stat(path), what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise InputError(
            f"{name}: cannot read {what}: {exc.strerror or exc}", unopenable=True
        ) from None
    try:
        info = os.fstat(fd)  # the file opened, which may have been swapped since the stat
        _refuse_special(name, info, what)
        if info.st_size > max_bytes:
            raise InputError(
                f"{name}: {what} is {info.st_size} bytes, more than the "
                f"{format_bytes(max_bytes)} allowed"
            )
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise InputError(f"{name}: {what} is larger than {format_bytes(max_bytes)}")
    except OSError as exc:
        raise InputError(f"{name}: cannot read {what}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    return _decode(b"".join(chunks), name, what)


def _read_stdin(stream: IO[bytes] | None, *, max_bytes: int, what: str) -> bytes:
    if stream is None:
        if sys.stdin is None:
            raise InputError(f"{_STDIN_NAME}: cannot read {what}: no standard input")
        stream = sys.stdin.buffer
    try:
        data = stream.read(max_bytes + 1)  # a pipe or terminal: read until EOF, bounded
    except OSError as exc:
        raise InputError(f"{_STDIN_NAME}: cannot read {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InputError(f"{_STDIN_NAME}: {what} is larger than {format_bytes(max_bytes)}")
    return data


_SPECIAL_FILES: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_special(name: str, info: os.stat_result, what: str) -> None:
    if stat.S_ISREG(info.st_mode):
        return
    kind = next((k for test, k in _SPECIAL_FILES if test(info.st_mode)), "not a regular file")
    raise InputError(
        f"{name}: is {kind}, not a regular file: refusing to read it as {_article(what)}"
    )


def _decode(data: bytes, name: str, what: str) -> str:
    nul = data.find(b"\0")
    if nul >= 0:
        raise InputError(f"{name}: {what} is binary, not text (a NUL byte at byte offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{name}: {what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset "
            f"{exc.start}: {exc.reason})"
        ) from None


def _article(what: str) -> str:
    return f"an {what}" if what[:1] in "aeiou" else f"a {what}"


# ---------------------------------------------------------------------------------------------
# YAML


class _Loader(_SafeLoader):
    """The safe loader, with numbers bounded in length and bad dates a YAML error."""


def _bounded_number(
    construct: Callable[[SafeConstructor, yaml.ScalarNode], Any],
) -> Callable[[_Loader, yaml.Node], Any]:
    def bounded(loader: _Loader, node: yaml.Node) -> Any:
        assert isinstance(node, yaml.ScalarNode)
        if len(node.value) > MAX_NUMBER_CHARS:
            raise ConstructorError(
                None, None, f"a number of {len(node.value)} characters is too long", node.start_mark
            )
        return construct(loader, node)

    return bounded


def _checked_timestamp(loader: _Loader, node: yaml.Node) -> Any:
    assert isinstance(node, yaml.ScalarNode)
    try:
        return loader.construct_yaml_timestamp(node)
    except ValueError as exc:  # 2001-02-31 matches the pattern; datetime() refuses it
        raise ConstructorError(
            None, None, f"invalid timestamp {shorten(node.value)}: {exc}", node.start_mark
        ) from None


_Loader.add_constructor(
    "tag:yaml.org,2002:int", _bounded_number(SafeConstructor.construct_yaml_int)
)
_Loader.add_constructor(
    "tag:yaml.org,2002:float", _bounded_number(SafeConstructor.construct_yaml_float)
)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _checked_timestamp)


@dataclass(slots=True)
class _Open:
    """A collection still open in the event scan."""

    anchor: str | None
    nodes: int = 1  # itself, plus its children with aliases expanded


def load_yaml_documents(text: str, *, where: str) -> list[Any]:
    """Every document of the YAML stream ``text`` (``None`` for an empty one), loaded safely.

    ``where`` names the source in messages (the file's name). First scans the event stream
    (iterative; stops at the first offence) and refuses a document nesting deeper than
    ``MAX_DEPTH`` or whose aliases would expand to more than ``MAX_ALIAS_NODES`` nodes. Raises
    ``InputError``: one line with the position and a shortened problem.
    """
    shown = printable(where)
    try:
        _scan(text, shown)
        return list(yaml.load_all(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        raise InputError(f"{shown}: not valid YAML{_yaml_problem(exc)}") from None
    except (ValueError, OverflowError, RecursionError) as exc:  # a constructor's own error
        raise InputError(f"{shown}: not valid YAML: {_one_line(str(exc))}") from None


def _scan(text: str, where: str) -> None:
    document = 0
    stack: list[_Open] = []
    anchored: dict[str, int] = {}  # anchor → nodes it stands for, expanded
    alias_nodes = 0

    def add(nodes: int, anchor: str | None) -> None:
        if anchor is not None:
            anchored[anchor] = nodes
        if stack:
            stack[-1].nodes += nodes

    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.DocumentStartEvent):
            document += 1
            anchored.clear()  # anchors do not cross documents
            alias_nodes = 0
        elif isinstance(event, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                raise InputError(
                    f"{where}: document {document} nests deeper than {MAX_DEPTH} levels"
                    f"{_at(event.start_mark)}: refusing it"
                )
            stack.append(_Open(anchor=event.anchor))
        elif isinstance(event, yaml.CollectionEndEvent):
            closed = stack.pop()
            add(closed.nodes, closed.anchor)
        elif isinstance(event, yaml.ScalarEvent):
            add(1, event.anchor)
        elif isinstance(event, yaml.AliasEvent):
            if any(open_.anchor == event.anchor for open_ in stack):
                raise InputError(
                    f"{where}: document {document}: alias *{shorten(event.anchor)[1:-1]} "
                    f"refers to a collection that contains it{_at(event.start_mark)}: "
                    "refusing a recursive structure"
                )
            nodes = anchored.get(event.anchor or "", 1)  # undefined: the loader reports it
            alias_nodes += nodes
            if alias_nodes > MAX_ALIAS_NODES:
                raise InputError(
                    f"{where}: document {document}: aliases expand to more than "
                    f"{MAX_ALIAS_NODES} nodes{_at(event.start_mark)}: refusing it "
                    "(a 'billion laughs'?)"
                )
            add(nodes, None)


class _Mark(Protocol):
    line: int
    column: int


def _at(mark: _Mark | None) -> str:
    if mark is None:
        return ""
    return f" (line {mark.line + 1}, column {mark.column + 1})"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = exc.problem or exc.context or "invalid"
        return f"{where}: {_one_line(problem)}"
    if isinstance(exc, yaml.reader.ReaderError):
        return f" at character {exc.position}: {_one_line(exc.reason)}"
    return f": {_one_line(str(exc))}"


def _one_line(text: str, limit: int = 200) -> str:
    """What YAML says (it may quote the text) on one line, escaped, at most ``limit`` long."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------
# Pods and pod templates

TEMPLATE_PATHS: Mapping[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template"),
    "StatefulSet": ("spec", "template"),
    "DaemonSet": ("spec", "template"),
    "ReplicaSet": ("spec", "template"),
    "ReplicationController": ("spec", "template"),
    "Job": ("spec", "template"),
    "CronJob": ("spec", "jobTemplate", "spec", "template"),
    "PodTemplate": ("template",),
}
"""Where each built-in workload kind keeps the pod template its pods are made from."""

_STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")


@dataclass(frozen=True, slots=True, kw_only=True)
class PodManifest:
    """A Pod, or a workload's pod template, found in a manifest."""

    where: str
    """The source and position: ``pods.yaml: document 2 item 0``."""
    kind: str
    """``Pod``, or the workload's kind (``Deployment``, ``CronJob``, …)."""
    object: Mapping[str, Any]
    """The whole object: the Pod itself, or the workload."""
    template_path: str | None
    """Where the pod template is in ``object`` (``spec.template``); ``None`` for a Pod."""
    pod: Mapping[str, Any]
    """The Pod, or the pod template (its ``metadata`` and ``spec``); ``{}`` if unreachable."""
    problems: tuple[str, ...] = ()
    """Wrong shapes found on the way to and in the pod (``spec is a str, not a mapping``)."""

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The object's own metadata (the workload's, for a template); ``{}`` if not a mapping."""
        meta = self.object.get("metadata")
        return meta if isinstance(meta, Mapping) else {}

    @property
    def description(self) -> str:
        """``Deployment team-a/web (pod template)``, ``Pod default/trainer``."""
        namespace = self.metadata.get("namespace")
        name = self.metadata.get("name")
        if name is None:
            name = self.metadata.get("generateName")
        shown = (
            f"{namespace if isinstance(namespace, str) and namespace else 'default'}/"
            f"{name if isinstance(name, str) and name else '<no name>'}"
        )
        return f"{self.kind} {shown}" + (" (pod template)" if self.template_path else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class OtherObject:
    """An object that is not a Pod nor (when asked for) a workload with a pod template."""

    where: str
    kind: str | None
    """Its kind; ``None`` when it has none (not a Kubernetes object)."""
    object: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The object itself (``check-pod`` reads the ResourceClaims and templates among them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeProblem:
    """Something where an object or a list of objects was expected."""

    where: str
    problem: str

    @property
    def message(self) -> str:
        return f"{self.where}: {self.problem}"


Found = PodManifest | OtherObject | ShapeProblem


def pod_manifests(
    document: object, *, where: str, templates: bool = True, default_kind: str | None = None
) -> Iterator[Found]:
    """The Pods (and, with ``templates``, workload pod templates) of one loaded YAML document.

    A document is an object or a list of them (``kind: List``, ``PodList``, ``*List``, or no
    kind with ``items``); list items are not lists again. ``where`` is the document's position
    (``pods.yaml: document 2``); items add `` item N``. An object without a ``kind`` is of
    ``default_kind`` (a pods file may omit it). Never raises on any shape.
    """
    if document is None:
        return
    if not isinstance(document, Mapping):
        yield ShapeProblem(where=where, problem=_not_an_object(document))
        return
    kind = document.get("kind", default_kind)
    if _is_list(kind, document):
        items = document.get("items")
        if items is None:
            return
        if not isinstance(items, list):
            yield ShapeProblem(where=where, problem=f"items is {_a(items)}, not a list")
            return
        for index, item in enumerate(items):
            item_where = f"{where} item {index}"
            if isinstance(item, Mapping):
                yield _object(item, item_where, templates, default_kind)
            else:
                yield ShapeProblem(where=item_where, problem=_not_an_object(item))
        return
    yield _object(document, where, templates, default_kind)


def _is_list(kind: object, document: Mapping[str, Any]) -> bool:
    if isinstance(kind, str) and kind.endswith("List"):
        return True
    return kind is None and "items" in document


def _object(obj: Mapping[str, Any], where: str, templates: bool, default_kind: str | None) -> Found:
    kind = obj.get("kind", default_kind)
    if kind is not None and not isinstance(kind, str):
        return ShapeProblem(where=where, problem=f"kind is {_a(kind)}, not a string")
    if kind == "Pod":
        return PodManifest(
            where=where,
            kind=kind,
            object=obj,
            template_path=None,
            pod=obj,
            problems=tuple(_pod_problems(obj, prefix="", status=True)),
        )
    path = TEMPLATE_PATHS.get(kind or "")
    if not templates or path is None or kind is None:
        return OtherObject(where=where, kind=kind, object=obj)
    problems = [f"metadata is {_a(obj['metadata'])}, not a mapping"] if _bad_metadata(obj) else []
    node: object = obj
    template: Mapping[str, Any] = {}  # stays empty where the path to the template is broken
    for depth, key in enumerate(path):
        assert isinstance(node, Mapping)
        child = node.get(key)
        dotted = ".".join(path[: depth + 1])
        if child is None:
            problems.append(f"{dotted} is missing")
            break
        if not isinstance(child, Mapping):
            problems.append(f"{dotted} is {_a(child)}, not a mapping")
            break
        node = child
    else:
        assert isinstance(node, Mapping)
        problems.extend(_pod_problems(node, prefix=".".join(path) + ".", status=False))
        template = node
    return PodManifest(
        where=where,
        kind=kind,
        object=obj,
        template_path=".".join(path),
        pod=template,
        problems=tuple(problems),
    )


def _bad_metadata(obj: Mapping[str, Any]) -> bool:
    return obj.get("metadata") is not None and not isinstance(obj.get("metadata"), Mapping)


def _pod_problems(pod: Mapping[str, Any], *, prefix: str, status: bool) -> Iterator[str]:
    """The shapes ``pod_from_json`` and ``check-pod`` rely on: mappings where mappings go."""
    metadata = pod.get("metadata")
    if _bad_metadata(pod):
        yield f"{prefix}metadata is {_a(metadata)}, not a mapping"
    elif isinstance(metadata, Mapping):
        annotations = metadata.get("annotations")
        if annotations is not None and not isinstance(annotations, Mapping):
            yield f"{prefix}metadata.annotations is {_a(annotations)}, not a mapping"
    spec = pod.get("spec")
    if spec is not None and not isinstance(spec, Mapping):
        yield f"{prefix}spec is {_a(spec)}, not a mapping"
    if not status:
        return
    pod_status = pod.get("status")
    if pod_status is None:
        return
    if not isinstance(pod_status, Mapping):
        yield f"{prefix}status is {_a(pod_status)}, not a mapping"
        return
    for key in _STATUS_LISTS:
        entries = pod_status.get(key)
        if entries is None:
            continue
        if not isinstance(entries, list):
            yield f"{prefix}status.{key} is {_a(entries)}, not a list"
            continue
        for index, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                yield f"{prefix}status.{key}[{index}] is {_a(entry)}, not a mapping"


def _not_an_object(value: object) -> str:
    return f"is {_a(value)}, not a Kubernetes object (a mapping)"


def _a(value: object) -> str:
    """``a str``, ``an int``, ``a list``: the YAML value's type, never the value itself."""
    name = type(value).__name__
    return f"an {name}" if name[:1] in "aeiou" else f"a {name}"
