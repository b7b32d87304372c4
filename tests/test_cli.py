"""``gpuguard``'s exit codes and argument checks, across every subcommand (docs/design.md, CLI
outputs: 0 success or valid, 1 invalid input or a failed check, 2 usage or config error).

A usage error (a flag out of range, NaN, infinite, a non-ASCII digit, an empty path) and an invalid
config file are exit 2 with one message on stderr and never a traceback, whichever command it is.
The table over the parser below fails when a new subcommand or flag is added without a check.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from gpuguard.cli import build_parser, main
from gpuguard.commands.demo.scenario import minimum_duration_seconds
from rigs.cli_run import run_gpuguard
from tests.helpers.environment import environ_without_gpuguard_settings

MIN_DEMO = minimum_duration_seconds()

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
POD_FILE = FIXTURES / "pods" / "capped.yaml"
BAD_CONFIG = "version = 1\n[node]\nno_such_key = 1\n"


def _gpuguard(
    *argv: str, env: dict[str, str] | None = None, unset_prefix: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``gpuguard ARGV`` with warnings as errors, without the developer's ``GPUGUARD_*``
    settings (nor any variable starting with ``unset_prefix``) and with ``env`` added."""
    base = environ_without_gpuguard_settings()
    if unset_prefix is not None:
        base = {k: v for k, v in base.items() if not k.startswith(unset_prefix)}
    return run_gpuguard(
        *argv,
        timeout=60,
        memory_bytes=None,
        env={**base, "PYTHONWARNINGS": "error", **(env or {})},
    )


# One run per subcommand that reads a config, offline and online where both exist. None of them
# may get past loading the config: the pods file and node name only make the online paths
# reachable without a cluster.
ONLINE = ("--node-name", "n", "--pods-file", str(POD_FILE))
WITH_CONFIG: dict[str, tuple[str, ...]] = {
    "enforce": ("enforce", *ONLINE),
    "inspect": ("inspect", *ONLINE),
    "inspect --offline": ("inspect", "--offline"),
    "explain": ("explain", "1", *ONLINE),
    "explain --offline": ("explain", "1", "--offline"),
    "check-pod": ("check-pod", str(POD_FILE)),
    "agent": ("agent", "--node-name", "n"),
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_bad_config_table_covers_every_subcommand_that_takes_a_config() -> None:
    takes_config = {
        name
        for name, p in _subcommands().items()
        if any("--config" in a.option_strings for a in p._actions)
    }
    assert takes_config == {argv[0] for argv in WITH_CONFIG.values()}


@pytest.mark.parametrize("case", list(WITH_CONFIG))
def test_a_bad_config_file_is_exit_2_with_its_message_and_no_traceback(
    case: str, tmp_path: Path
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(BAD_CONFIG)
    done = _gpuguard(*WITH_CONFIG[case], "--config", str(config))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "no_such_key" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("case", ["explain --offline", "inspect --offline"])
def test_a_bad_config_named_by_the_environment_is_exit_2_too(case: str, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(BAD_CONFIG)
    done = _gpuguard(*WITH_CONFIG[case], env={"GPUGUARD_CONFIG": str(config)})
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "no_such_key" in done.stderr
    assert "Traceback" not in done.stderr


# Every numeric and path flag, with the values that used to pass argparse: int() and float()
# accept non-ASCII digits, signs, spaces and underscores, float() also nan/inf and 1e309 (inf),
# and an empty path was silently "not given".
_PORTS = ("-1", "65536", "70000", "١٢", " 80", "+80", "8_0")
_DURATIONS = ("nan", "NaN", "inf", "-inf", "1e309", "0", "-1", "86401", "1e9", "١٠", " 5")
_PIDS = ("١", "０", "+1", "1_0", "0", "-3", "4194305", "1" + "0" * 23)
_GPU_MEMORY = ("nan", "inf", "1e400", "9Ei", "2Pi", "0", "-1Gi", "8 Gi", "١Gi")
_PATH_FLAGS = {
    "--proc-root": (("enforce",), ("inspect",), ("explain", "1")),
    "--config": (("enforce",), ("inspect",), ("explain", "1"), ("check-pod", "p.yaml"), ("agent",)),
    "--kubeconfig": (("enforce",), ("inspect",), ("explain", "1"), ("agent",)),
    "--pods-file": (("enforce",), ("inspect",), ("explain", "1")),
    "--device-plugin-config": (("check-sharing", "s.yaml"),),
    "--mig-config": (("check-sharing", "s.yaml"),),
    "--node": (("check-sharing", "s.yaml"),),
}
USAGE_ERRORS: list[tuple[str, ...]] = [
    *(("demo", f"--metrics-port={v}") for v in _PORTS),
    *(("demo", f"--duration={v}") for v in _DURATIONS),
    *(("explain", v) for v in _PIDS),
    *(("check-pod", "p.yaml", f"--gpu-memory={v}") for v in _GPU_MEMORY),
    *((*cmd, f"{flag}=") for flag, cmds in _PATH_FLAGS.items() for cmd in cmds),
    ("explain", "1", "--proc-root", "/pr\0oc"),
    ("check-pod", ""),
    ("check-pod", "p.yaml", "p\0d.yaml"),
    ("check-sharing", ""),
    ("check-sharing", "s\0.yaml"),
    ("agent", "--allow-eviction=yes"),
]


@pytest.mark.parametrize("argv", USAGE_ERRORS, ids=repr)
def test_an_out_of_range_or_malformed_flag_is_a_usage_error(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"gpuguard {argv[0]}: error: argument " in err


@pytest.mark.parametrize(
    ("argv", "attr", "value"),
    [
        (("demo", "--metrics-port", "0"), "metrics_port", 0),
        (("demo", "--metrics-port", "65535"), "metrics_port", 65535),
        (("demo", "--duration", str(MIN_DEMO)), "duration", float(MIN_DEMO)),
        (("demo", "--duration", "1e2"), "duration", 100.0),
        (("demo", "--duration", "86400"), "duration", 86400.0),
        (("explain", "1"), "pid", 1),
        (("explain", "4194304"), "pid", 4194304),
        (("check-pod", "p.yaml", "--gpu-memory", "141Gi"), "gpu_memory", "141Gi"),
        (("explain", "1", "--proc-root", "/host/proc"), "proc_root", "/host/proc"),
        (("explain", "1", "--proc-root", "rel/proc"), "proc_root", str(Path.cwd() / "rel/proc")),
        (("inspect", "--proc-root", "rel/proc"), "proc_root", str(Path.cwd() / "rel/proc")),
        (("enforce", "--proc-root", "rel/proc"), "proc_root", str(Path.cwd() / "rel/proc")),
    ],
)
def test_values_at_the_bounds_are_accepted(argv: tuple[str, ...], attr: str, value: object) -> None:
    assert getattr(build_parser().parse_args(list(argv)), attr) == value


def test_main_maps_every_config_error_to_exit_2_in_one_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(BAD_CONFIG)
    for argv in (WITH_CONFIG["explain"], WITH_CONFIG["explain --offline"]):
        assert main([*argv, "--config", str(config)]) == 2
        assert "no_such_key" in capsys.readouterr().err


# -- a kubeconfig that cannot be used: one class, every command that talks to the API server ----

BAD_KUBECONFIGS = {
    "missing": "/nonexistent/kubeconfig",
    "not YAML": "garbage: [\n",
    "no context": "apiVersion: v1\nkind: Config\nclusters: []\n",
    "a directory": "",
}


@pytest.mark.parametrize(
    "command", [("agent", "--node-name", "n"), ("inspect", "--node-name", "n")]
)
@pytest.mark.parametrize("case", list(BAD_KUBECONFIGS))
def test_an_unusable_kubeconfig_is_exit_2_naming_it_without_a_traceback(
    command: tuple[str, ...], case: str, tmp_path: Path
) -> None:
    content = BAD_KUBECONFIGS[case]
    if case == "missing":
        path = content
    elif case == "a directory":
        path = str(tmp_path)
    else:
        (tmp_path / "kubeconfig").write_text(content)
        path = str(tmp_path / "kubeconfig")
    done = _gpuguard(*command, "--kubeconfig", path, "--log-level", "error")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"kube.kubeconfig {path!r}: not a usable kubeconfig" in done.stderr
    assert "Traceback" not in done.stderr


def test_outside_a_pod_without_a_kubeconfig_the_agent_says_how_to_give_one() -> None:
    """Inside a pod ``KUBERNETES_SERVICE_HOST`` would lead to the in-cluster config instead."""
    done = _gpuguard(
        "agent", "--node-name", "n", "--log-level", "error", unset_prefix="KUBERNETES_"
    )
    assert done.returncode == 2, done.stderr
    assert "no in-cluster Kubernetes config" in done.stderr
    assert "--kubeconfig" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_start_failure_of_enforce_surfaces_as_itself_not_as_the_metrics_servers_stop() -> None:
    """Before the fix, NVML failing to load was hidden behind "cannot join thread before it is
    started" from stopping a metrics server never started."""
    env = {
        "LD_LIBRARY_PATH": "/nonexistent",
        "GPUGUARD_NVML_LIBRARY_PATH": "/nonexistent/libnvidia-ml.so.1",
    }
    done = _gpuguard(
        "enforce",
        "--node-name",
        "n",
        "--metrics-address",
        "127.0.0.1:0",
        "--log-level",
        "error",
        env=env,
    )
    assert done.returncode == 1, done.stderr
    assert "NVML" in done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot join thread" not in done.stderr


def test_agent_help_teaches_the_policies_and_the_check_first() -> None:
    done = _gpuguard("agent", "--help")
    assert done.returncode == 0
    for phrase in ("WhenIdle", "Drain", "check-sharing", "gpuguard-sharing", "--allow-eviction"):
        assert phrase in done.stdout


def _help(command: str | None) -> str:
    parser = build_parser() if command is None else _subcommands()[command]
    return parser.format_help()


@pytest.mark.parametrize("command", ["inspect", "explain"])
def test_inspect_and_explain_help_show_examples_and_say_they_need_nvml_and_root(
    command: str,
) -> None:
    text = " ".join(_help(command).split())
    assert f"examples: kubectl -n gpuguard exec ds/gpuguard -c enforcer -- gpuguard {command}" in (
        text
    )
    assert f"sudo gpuguard {command}" in text
    for phrase in ("NVML", "Run it as root", "/proc/<pid>/fd", "CAP_SYS_PTRACE"):
        assert phrase in text, phrase


def test_enforce_help_says_the_mode_defaults_to_audit() -> None:
    text = " ".join(_help("enforce").split())
    assert "--mode {enforce,audit} enforce: stop containers" in text
    assert "default audit" in text
    assert "In audit mode (the default) it decides the same and sends nothing" in text


@pytest.mark.parametrize("command", [None, "enforce", "agent", "inspect", "explain", "check-pod"])
def test_help_prose_is_wrapped_to_the_terminal_and_examples_kept_as_written(
    command: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The descriptions were single lines of 300+ characters under RawDescriptionHelpFormatter;
    only indented lines (examples, options) may run past the width."""
    monkeypatch.setenv("COLUMNS", "72")
    lines = _help(command).splitlines()
    long = [line for line in lines if len(line) > 70 and not line[:1].isspace()]
    assert long == []
    if command is None:
        assert '  gpuguard.io/gpu-memory-limit: "8Gi"   (or "25%" of the device\'s memory)' in lines


def test_no_help_text_cites_a_design_section_readers_cannot_open() -> None:
    for command in [None, *_subcommands()]:
        assert "DESIGN" not in _help(command), command
    assert "docs/design.md" in _help(None)


def test_inspect_without_nvml_names_the_setting_that_points_at_the_library() -> None:
    done = _gpuguard(
        "inspect",
        "--offline",
        env={"GPUGUARD_NVML_LIBRARY_PATH": "/nonexistent/libnvidia-ml.so.1"},
    )
    assert done.returncode == 1, done.stderr
    assert "cannot load NVML library /nonexistent/libnvidia-ml.so.1" in done.stderr
    assert "(nvml.library_path, GPUGUARD_NVML_LIBRARY_PATH)" in done.stderr
    assert "Traceback" not in done.stderr
