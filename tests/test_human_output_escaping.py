"""Every command's human output shows what others wrote escaped, never raw.

A pod name, namespace, annotation, container or claim name, process or cgroup name, file name
or the text of a file reaches the admin's terminal in tables, per-pod lines, warnings and
errors; a control character in one (``ESC [2K``, ``\\r``, backspaces, the C1 CSI ``\\x9b``,
``U+202E``, a newline and a fake ``ok`` row) would redraw what the admin reads. The table below
drives the real command line (``gpuguard.cli.main``) with real files, once per command, output
path and hostile string, and checks that the output holds no control character but its own line
breaks and that the hostile text is still there, escaped (``core.text.printable``). A command
of the parser that is neither in the table nor said to show nothing of others' fails the table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import structlog
import yaml

from gpuguard import logs
from gpuguard.cli import build_parser, main
from gpuguard.core.text import display_width, pad, printable
from rigs.nvml_stub import build_stub

HOSTILE: dict[str, str] = {
    "erase-line": "\x1b[2K\x1b[1Gok",
    "cursor-up-and-colour": "\x1b[1A\x1b[32mok\x1b[0m",
    "osc-title": "\x1b]0;owned\x07",
    "carriage-return": "bad\rok",
    "backspaces": "bad\b\b\bok",
    "delete": "a\x7fb",
    "nul": "a\x00b",
    "c1-csi": "a\x9b2Kb",
    "bidi-override": "a\u202eb",
    "line-separator": "a\u2028b",
    "fake-ok-row": "x\nPod  default  fake  ok",
}
"""Each is short enough that no message shortens it (32 characters: an annotation's value)."""

FAKE_ROW = "Pod  default  fake"
UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
CONTAINER_ID = "a" * 60 + "c0de"
PID = 70
GI = 1 << 30

Argv = Callable[[Path, str], list[str]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One output path of one command: how to get the hostile text there, and where it shows."""

    argv: Argv
    """Writes the files under the directory given and returns the command line (the command's
    name first)."""
    stream: Literal["stdout", "stderr"] = "stdout"
    shown: Callable[[str], str] = printable
    """The hostile text as the output shows it (a config value: quoted as JSON, then escaped)."""
    carries: Callable[[str], bool] = lambda text: True
    """Whether the input can hold the text at all (no NUL in a file name or an argument)."""
    env: Callable[[Path, str], dict[str, str]] = field(default=lambda root, text: {})


def _no_nul(text: str) -> bool:
    return "\x00" not in text


def _in_a_line(text: str) -> bool:
    """A kernel name (a cgroup's, a process's): no NUL, and ``\\n`` ends a cgroup line."""
    return "\x00" not in text and "\n" not in text


def _file_name(text: str) -> str:
    return f"m{text}.yaml"


def _yaml(root: Path, name: str, *objects: object) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False), encoding="utf-8")
    return path


def _pod(
    name: str = "p",
    *,
    namespace: str = "team-a",
    annotation: str | None = "4Gi",
    containers: list[dict[str, object]] | None = None,
) -> dict[str, object]:
    meta: dict[str, object] = {"name": name, "namespace": namespace}
    if annotation is not None:
        meta["annotations"] = {"gpuguard.io/gpu-memory-limit": annotation}
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": containers or [{"name": "main", **gpu}]},
    }


def _check_pod(*objects: object, config: str | None = None, name: str = "m.yaml") -> Argv:
    def argv(root: Path, text: str) -> list[str]:
        flags = []
        if config is not None:
            (root / "config.toml").write_text(config, encoding="utf-8")
            flags = ["--config", str(root / "config.toml")]
        made = [o(text) if callable(o) else o for o in objects]
        return ["check-pod", str(_yaml(root, name.format(text), *made)), *flags]

    return argv


def _config_value(text: str) -> str:
    """How a config problem quotes a string value: as JSON (TOML) spells it, then escaped."""
    return printable(json.dumps(text, ensure_ascii=False))


def _toml_config(root: Path, body: str) -> Path:
    path = root / "config.toml"
    path.write_text("version = 1\n" + body, encoding="utf-8")
    return path


def _unknown_key(text: str) -> str:
    return f"[enforcement]\n{json.dumps(text)} = 1\n"


def _bad_value(text: str) -> str:
    return f"[limits]\nsources = [{json.dumps(text)}]\n"


# DRA claim, request and container names are read only when printable (kubemodel.dra,
# dra_templates): none of HOSTILE gets that far, and the share lines escape them anyway.
CHECK_POD: dict[str, Case] = {
    "table: namespace": Case(argv=_check_pod(lambda t: _pod(namespace=t))),
    "table: name": Case(argv=_check_pod(lambda t: _pod(t))),
    "pod heading: object": Case(argv=_check_pod(lambda t: _pod(t, annotation="nope"))),
    "pod heading: file name": Case(
        argv=_check_pod(_pod(annotation="nope"), name="m{}.yaml"), carries=_no_nul
    ),
    "error line: annotation value": Case(argv=_check_pod(lambda t: _pod(annotation=t))),
    "warning line: generateName": Case(
        argv=_check_pod(
            lambda t: {**_pod(), "metadata": {"generateName": t, "namespace": "team-a"}}
        )
    ),
    "declared line: container name": Case(
        argv=_check_pod(
            lambda t: _pod(
                annotation="8Gi",
                containers=[{"name": t, "resources": {"limits": {"nvidia.com/gpumem": 4000}}}],
            ),
            config='version = 1\n[limits]\nsources = ["gpuguard", "hami"]\n',
        )
    ),
    "stderr: skipped kinds": Case(
        argv=_check_pod(_pod(), lambda t: {"kind": t, "metadata": {"name": "x"}}),
        stream="stderr",
    ),
    "stderr: wrong shape in a file": Case(
        argv=_check_pod({"kind": "List", "items": 3}, name="m{}.yaml"),
        stream="stderr",
        carries=_no_nul,
    ),
    "stderr: invalid YAML": Case(
        argv=lambda root, text: [
            "check-pod",
            str(_written(root / _file_name(text), "a: [\n")),
        ],
        stream="stderr",
        carries=_no_nul,
    ),
    "stderr: a file that cannot be opened": Case(
        argv=lambda root, text: ["check-pod", str(root / _file_name(text))],
        stream="stderr",
        carries=_no_nul,
    ),
    "stderr: --config unknown key": Case(
        argv=lambda root, text: [
            "check-pod",
            str(_yaml(root, "m.yaml", _pod())),
            "--config",
            str(_toml_config(root, _unknown_key(text))),
        ],
        stream="stderr",
    ),
    "stderr: --config bad value": Case(
        argv=lambda root, text: [
            "check-pod",
            str(_yaml(root, "m.yaml", _pod())),
            "--config",
            str(_toml_config(root, _bad_value(text))),
        ],
        stream="stderr",
        shown=_config_value,
    ),
    "stderr: --gpu-memory": Case(
        argv=lambda root, text: [
            "check-pod",
            str(_yaml(root, "m.yaml", _pod())),
            f"--gpu-memory={text}",
        ],
        stream="stderr",
        carries=_no_nul,
    ),
}


def _written(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


SHARING = """\
version: v1
devicePluginConfig: {namespace: gpu-operator, name: nvidia-time-slicing-config}
rules:
  - name: t4-shared
    nodeNames: [t4-1]
    timeSlicing: slice-4
"""
NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "t4-1"}}


def _sharing(root: Path) -> list[str]:
    return ["check-sharing", str(_written(root / "sharing.yaml", SHARING))]


CHECK_SHARING: dict[str, Case] = {
    "report: file name": Case(
        argv=lambda root, text: [
            "check-sharing",
            str(_written(root / _file_name(text), SHARING)),
        ],
        carries=_no_nul,
    ),
    "errors: rule name": Case(
        argv=lambda root, text: [
            "check-sharing",
            str(_written(root / "s.yaml", SHARING.replace("t4-shared", json.dumps(text)))),
        ]
    ),
    "errors: a device plugin profile named after its file": Case(
        argv=lambda root, text: [
            *_sharing(root),
            "--device-plugin-config",
            str(_written(root / f"{text}.yaml", "version: v1\n")),
            "--node",
            str(_yaml(root, "nodes.yaml", NODE)),
        ],
        carries=_no_nul,
    ),
    "stderr: a file that cannot be checked": Case(
        argv=lambda root, text: [
            *_sharing(root),
            "--node",
            str(_yaml(root, _file_name(text), {"kind": "Pod"})),
        ],
        stream="stderr",
        carries=_no_nul,
    ),
}


def _proc(root: Path, *, comm: str = "python", cgroup: str | None = None) -> Path:
    """A ``/proc`` tree with one process, ``PID``, in ``UID``'s container ``CONTAINER_ID``."""
    d = root / "proc" / str(PID)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", *["0"] * 18, "7", *["0"] * 30]
    (d / "stat").write_text(f"{PID} ({comm}) {' '.join(fields)}\n", encoding="utf-8")
    line = cgroup or f"/kubepods/besteffort/pod{UID}/{CONTAINER_ID}"
    (d / "cgroup").write_text(f"0::{line}\n", encoding="utf-8")
    return root / "proc"


def _pods_file(
    root: Path, *, namespace: str = "team-a", name: str = "p", container: str = "main"
) -> Path:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": UID,
            "annotations": {"gpuguard.io/gpu-memory-limit": "4Gi"},
        },
        "spec": {"nodeName": "n", "containers": [{"name": container}]},
        "status": {
            "containerStatuses": [
                {"name": container, "containerID": f"containerd://{CONTAINER_ID}"}
            ]
        },
    }
    return _yaml(root, "pods.yaml", pod)


def _online(root: Path, pods: Path) -> list[str]:
    return ["--node-name", "n", "--pods-file", str(pods)]


def _no_nvml(root: Path, text: str) -> dict[str, str]:
    return {"GPUGUARD_NVML_LIBRARY_PATH": str(root / "no-libnvidia-ml.so.1")}


EXPLAIN: dict[str, Case] = {
    "cgroup lines": Case(
        argv=lambda root, text: [
            "explain",
            str(PID),
            "--offline",
            "--proc-root",
            str(_proc(root, cgroup=f"/system.slice/{text}.service")),
        ],
        carries=_in_a_line,
    ),
    "pod, namespace and container": Case(
        argv=lambda root, text: [
            "explain",
            str(PID),
            "--proc-root",
            str(_proc(root)),
            *_online(root, _pods_file(root, namespace=f"ns{text}", name=text, container=text)),
        ],
        env=_no_nvml,
    ),
    "pod lookup error: pods file name": Case(
        argv=lambda root, text: [
            "explain",
            str(PID),
            "--proc-root",
            str(_proc(root)),
            *_online(root, root / _file_name(text)),
        ],
        carries=_no_nul,
        env=_no_nvml,
    ),
    "stderr: --proc-root": Case(
        argv=lambda root, text: [
            "explain",
            str(PID),
            "--offline",
            "--proc-root",
            str(_written(root / text, "")),
        ],
        stream="stderr",
        carries=_no_nul,
    ),
}


def _nvml(root: Path, text: str) -> dict[str, str]:
    scenario = root / "nvml.json"
    processes = [{"pid": PID, "used_bytes": GI}]
    device = {
        "uuid": "GPU-1",
        "name": "NVIDIA H100",
        "total_bytes": 80 * GI,
        "processes": processes,
    }
    scenario.write_text(json.dumps({"devices": [device]}), encoding="utf-8")
    return {"NVML_STUB_SCENARIO": str(scenario), "GPUGUARD_NVML_LIBRARY_PATH": str(build_stub())}


KUBECONFIG_WITHOUT_ITS_CONTEXT = """\
apiVersion: v1
kind: Config
current-context: ctx
contexts: []
clusters: []
users: []
"""


def _kubeconfig(root: Path, text: str) -> Path:
    """A kubeconfig named after ``text`` that the kubernetes client refuses with a message naming
    its file as it is: gpuguard quotes that message in a ``ConfigError`` it does not escape, so
    only the command line's last word (``cli.main``) stands between it and the terminal."""
    return _written(root / _file_name(text), KUBECONFIG_WITHOUT_ITS_CONTEXT)


def _one_word(text: str) -> bool:
    """Survives the client's message as written: no NUL, no whitespace (gpuguard joins its words
    with single spaces, so a newline or ``\r`` there is gone before it could be shown)."""
    return "\x00" not in text and text.split() == [text]


INSPECT: dict[str, Case] = {
    "table: process name": Case(
        argv=lambda root, text: [
            "inspect",
            "--proc-root",
            str(_proc(root, comm=text)),
            *_online(root, _pods_file(root)),
        ],
        carries=_in_a_line,
        env=_nvml,
    ),
    "stderr: a kubeconfig's file name": Case(
        argv=lambda root, text: [
            "inspect",
            "--node-name",
            "n",
            "--kubeconfig",
            str(_kubeconfig(root, text)),
        ],
        stream="stderr",
        carries=_one_word,
        env=_nvml,
    ),
    "table: pod and container": Case(
        argv=lambda root, text: [
            "inspect",
            "--proc-root",
            str(_proc(root)),
            *_online(root, _pods_file(root, namespace=f"ns{text}", name=text, container=text)),
        ],
        env=_nvml,
    ),
}


def _startup(command: str) -> dict[str, Case]:
    """A daemon's only human output before it runs: why its settings are refused (its log lines,
    rendered for a terminal, are the log tests' below)."""
    return {
        "stderr: config unknown key": Case(
            argv=lambda root, text: [
                command,
                "--config",
                str(_toml_config(root, _unknown_key(text))),
            ],
            stream="stderr",
        ),
        "stderr: config bad value": Case(
            argv=lambda root, text: [
                command,
                "--config",
                str(_toml_config(root, _bad_value(text))),
            ],
            stream="stderr",
            shown=_config_value,
        ),
        "stderr: unknown GPUGUARD_ variable": Case(
            argv=lambda root, text: [command, "--config", str(_toml_config(root, ""))],
            stream="stderr",
            carries=lambda text: "\x00" not in text and "=" not in text,
            env=lambda root, text: {f"GPUGUARD_X{text}": "1"},
        ),
        "stderr: a kubeconfig's file name": Case(
            argv=lambda root, text: [
                command,
                "--node-name",
                "n",
                "--kubeconfig",
                str(_kubeconfig(root, text)),
            ],
            stream="stderr",
            carries=_one_word,
            env=_nvml,
        ),
    }


PATHS: dict[str, dict[str, Case]] = {
    "check-pod": CHECK_POD,
    "check-sharing": CHECK_SHARING,
    "explain": EXPLAIN,
    "inspect": INSPECT,
    "enforce": _startup("enforce"),
    "agent": _startup("agent"),
}
"""Every command that shows others' text, and every path of its human output that does."""

NO_TENANT_INPUT: dict[str, str] = {
    "demo": "plays a scenario built into gpuguard: every name it shows is its own, and its "
    "flags are numbers",
}
"""Commands whose human output shows nothing that others wrote, and why."""


def _cases() -> Iterator[object]:
    for command, paths in PATHS.items():
        for path, case in paths.items():
            for hostile, text in HOSTILE.items():
                if case.carries(text):
                    yield pytest.param(command, path, text, id=f"{command}|{path}|{hostile}")


def _raw_controls(text: str) -> list[str]:
    """Every character of ``text`` a terminal could obey, but the line breaks."""
    return [ch for ch in text if not ch.isprintable() and ch != "\n"]


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No developer ``GPUGUARD_*`` setting, no forced colours, a wide table."""
    for name in list(os.environ):
        if name.startswith("GPUGUARD_") or name in ("NODE_NAME", "FORCE_COLOR", "TTY_COMPATIBLE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "400")


@pytest.mark.parametrize(("command", "path", "text"), list(_cases()))
@pytest.mark.usefixtures("clean_environment")
def test_every_human_output_path_shows_hostile_text_escaped_never_raw(
    command: str,
    path: str,
    text: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    case = PATHS[command][path]
    argv = case.argv(tmp_path, text)
    assert argv[0] == command
    for name, value in case.env(tmp_path, text).items():
        monkeypatch.setenv(name, value)
    with contextlib.suppress(SystemExit):  # argparse's usage error: a message on stderr too
        main(argv)
    out, err = capsys.readouterr()
    assert _raw_controls(out) == [], out
    assert _raw_controls(err) == [], err
    shown = out if case.stream == "stdout" else err
    assert case.shown(text) in shown, (case.shown(text), out, err)
    assert not any(line.startswith(FAKE_ROW) for line in (out + err).splitlines())


def _subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_the_table_covers_every_command_of_the_parser() -> None:
    """A new command is added here with its output paths, or with why it shows nothing of
    others'; a command in both is a mistake."""
    assert set(PATHS) | set(NO_TENANT_INPUT) == _subcommands()
    assert not set(PATHS) & set(NO_TENANT_INPUT)
    assert all(PATHS.values())


@pytest.mark.parametrize(
    ("text", "escaped"),
    [
        ("\x1b[2K", "\\x1b[2K"),
        ("a\rb\bc\x7f\x00", "a\\rb\\x08c\\x7f\\x00"),
        ("\x9b\u202e\u2028\U000e0001", "\\x9b\\u202e\\u2028\\U000e0001"),
        ("tab\there\nnext", "tab\\there\\nnext"),
        ("é 日本 C:\\path", "é 日本 C:\\path"),
    ],
)
def test_printable_escapes_what_a_terminal_would_obey_and_keeps_the_rest(
    text: str, escaped: str
) -> None:
    assert printable(text) == escaped
    assert printable(printable(text)) == escaped  # escaping twice changes nothing
    assert printable("one\x1b\ntwo", line_breaks=True) == "one\\x1b\ntwo"


def test_columns_are_padded_by_the_cells_text_takes() -> None:
    assert display_width("日本") == 4
    assert display_width("e\u0301") == 1
    assert pad("日本", 6) == "日本  "
    assert pad("abc", 2) == "abc"


@pytest.fixture
def root_logger_restored() -> Iterator[None]:
    """``logs.configure`` replaces the root logger's handlers and level: put pytest's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _logged(*, json_lines: bool, text: str) -> str:
    """What ``logs.configure`` writes for one of the enforcer's events naming a hostile pod (and
    a key spelled by it, as a splatted mapping would be) and one library's stdlib warning."""
    out = io.StringIO()
    logs.configure(level="info", json=json_lines, stream=out)
    structlog.get_logger("gpuguard.test").warning(
        "container_killed", namespace=f"ns{text}", pod=text, **{f"label{text}": "v"}
    )
    logging.getLogger("kubernetes.client.rest").warning("pod %s not found", text)
    return out.getvalue()


def _console_value(text: str) -> str:
    """How the console renderer shows an escaped string: bare, or as ``repr`` where it holds a
    space, ``=`` or a quote (so an escape's backslash shows doubled there)."""
    shown = printable(text)
    return repr(shown) if set(shown) & set(" =\"'") else shown


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
@pytest.mark.usefixtures("root_logger_restored")
def test_log_lines_rendered_for_a_terminal_show_hostile_text_escaped_never_raw(text: str) -> None:
    out = _logged(json_lines=False, text=text)
    assert _raw_controls(out) == [], out
    lines = out.splitlines()
    assert len(lines) == 2, out  # no line of its own for a newline in a name
    event, foreign = lines
    assert "container_killed" in event.split()  # the event name stays as written
    assert f"pod={_console_value(text)}" in event, event
    assert f"namespace={_console_value(f'ns{text}')}" in event, event
    assert f"{printable(f'label{text}')}=v" in event, event
    assert printable(f"pod {text} not found") in foreign, foreign


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
@pytest.mark.usefixtures("root_logger_restored")
def test_json_log_lines_carry_the_exact_value(text: str) -> None:
    """JSON escapes on its own: the terminal's escaping never reaches it."""
    event, foreign = (json.loads(line) for line in _logged(json_lines=True, text=text).splitlines())
    assert (event["event"], event["pod"], event[f"label{text}"]) == ("container_killed", text, "v")
    assert foreign["event"] == f"pod {text} not found"
