"""The start-up self-checks. The host PID namespace (docs/design.md, Safety invariants): fixture
status files, the real one, and real child PID namespaces made with ``unshare`` (with and without
their own /proc). The privileges: a ``CapEff`` table, the rule for other users' ``fd/`` checked
against the real kernel with ``setpriv``, and the real ``gpuguard enforce`` run as uid 65534 without
capabilities."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.selfcheck import (
    INIT_PID_NAMESPACE_INODE,
    check_host_pid_namespace,
    check_privileges,
    check_proc_readable,
)
from gpuguard.app import refuse_without_privileges
from gpuguard.core.model import (
    EnforcementPolicy,
    LimitPolicy,
    Mode,
    NamespacePolicy,
    RefusalReason,
)
from rigs.cgroups import require
from rigs.cli_run import run_python_json
from rigs.controlplane import free_port
from rigs.nvml_stub import SCENARIO_ENV, Scenario
from tests.helpers.environment import environ_without_gpuguard_settings
from tests.helpers.http import http_get
from tests.nvml_stub.fixtures import gpu as nvml_gpu
from tests.nvml_stub.fixtures import stub_lib_fixture  # noqa: F401 (a fixture)

POD_FILE = Path(__file__).parent / "fixtures" / "pods" / "capped.yaml"

STATUS_HOST = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\nNSsid:\t1\n"
STATUS_NESTED = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\t7\nNSsid:\t1\n"
STATUS_TWICE_NESTED = "Name:\tgpuguard\nNSpid:\t4242\t77\t1\n"
STATUS_OLD_KERNEL = "Name:\tgpuguard\nTgid:\t4242\nPid:\t4242\n"


def status_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "status"
    p.write_text(text)
    return p


def ns_link(tmp_path: Path, target: str) -> Path:
    """A symlink whose target text is what readlink(/proc/self/ns/pid) returns."""
    link = tmp_path / "ns-pid"
    link.symlink_to(target)
    return link


def test_one_nspid_field_in_the_initial_namespace_is_the_host(tmp_path: Path) -> None:
    check = check_host_pid_namespace(
        status_file(tmp_path, STATUS_HOST),
        ns_link(tmp_path, f"pid:[{INIT_PID_NAMESPACE_INODE}]"),
    )

    assert check.ok
    assert check.reason is None


@pytest.mark.parametrize("status", [STATUS_NESTED, STATUS_TWICE_NESTED])
def test_more_than_one_nspid_field_is_refused_with_what_was_seen_and_the_fix(
    tmp_path: Path, status: str
) -> None:
    check = check_host_pid_namespace(status_file(tmp_path, status), None)

    assert not check.ok
    assert check.reason == "not_host_pid_namespace"
    assert "NSpid" in check.detail
    assert "hostPID: true" in check.detail


def test_one_nspid_field_in_a_child_namespace_with_its_own_proc_is_refused(
    tmp_path: Path,
) -> None:
    check = check_host_pid_namespace(
        status_file(tmp_path, STATUS_HOST), ns_link(tmp_path, "pid:[4026532179]")
    )

    assert not check.ok
    assert check.reason == "not_host_pid_namespace"
    assert "4026532179" in check.detail


def test_a_missing_nspid_line_or_status_file_is_unknown_and_refused(tmp_path: Path) -> None:
    old = check_host_pid_namespace(status_file(tmp_path, STATUS_OLD_KERNEL), None)
    missing = check_host_pid_namespace(tmp_path / "no-such-status", None)

    assert (old.ok, old.reason) == (False, "pid_namespace_unknown")
    assert (missing.ok, missing.reason) == (False, "pid_namespace_unknown")


def test_an_unreadable_namespace_link_leaves_the_decision_to_nspid(tmp_path: Path) -> None:
    host = check_host_pid_namespace(status_file(tmp_path, STATUS_HOST), tmp_path / "absent")
    nested = check_host_pid_namespace(status_file(tmp_path, STATUS_NESTED), tmp_path / "absent")

    assert host.ok
    assert not nested.ok


def test_the_real_process_passes_when_it_is_in_the_initial_pid_namespace() -> None:
    # Independent oracle: stat(2) of the namespace file, not readlink(2) as the check does.
    in_host = os.stat("/proc/self/ns/pid").st_ino == INIT_PID_NAMESPACE_INODE
    require(in_host, "the test runner is not in the initial PID namespace")

    check = check_host_pid_namespace()

    assert (check.ok, check.reason, check.detail) == (True, None, "in the host PID namespace")


CHECK_INSIDE = (
    "import json; from gpuguard.adapters.selfcheck import check_host_pid_namespace as c; "
    "r = c(); print(json.dumps({'ok': r.ok, 'reason': r.reason, 'detail': r.detail}))"
)


@pytest.mark.kernel
@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--mount-proc"], id="own-proc-one-nspid-field"),
        pytest.param([], id="host-proc-two-nspid-fields"),
    ],
)
def test_a_real_child_pid_namespace_refuses(flags: list[str]) -> None:
    require(os.geteuid() == 0, "unshare --pid needs root")
    require(shutil.which("unshare") is not None, "unshare (util-linux) not installed")
    result = run_python_json("-c", CHECK_INSIDE, wrapper=["unshare", "--pid", "--fork", *flags])

    assert result["ok"] is False
    assert result["reason"] == "not_host_pid_namespace"
    assert "hostPID: true" in result["detail"]


# ---------------------------------------------------------------------------------------------
# The privilege self-check: may this process signal, and look into, the
# processes of other users? Decided on CapEff, never on the uid.

CAPS_ALL = "000001ffffffffff"
"""Every capability of a 6.x kernel (CAP_LAST_CAP 40): root with the default bounding set."""
CAPS_KILL_ONLY = "0000000000000020"
"""The chart's enforcer: runAsUser 0, capabilities drop ALL, add KILL (bit 5)."""
CAPS_NONE = "0000000000000000"
CAPS_DOCKER_DEFAULT_NO_KILL = "00000000a80425db"
"""A container runtime's default set (CHOWN … SETFCAP) with KILL (0x20) removed."""
CAPS_KILL_PTRACE_DAC_READ_SEARCH = "0000000000080024"


def status_text(*, uid: int = 0, cap_eff: str | None = CAPS_ALL) -> str:
    lines = ["Name:\tgpuguard", f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}", "CapInh:\t0000000000000000"]
    if cap_eff is not None:
        lines.append(f"CapEff:\t{cap_eff}")
    return "\n".join([*lines, "CapBnd:\t000001ffffffffff", ""])


@pytest.mark.parametrize(
    ("status", "can_signal", "reads_gpu_files", "says"),
    [
        pytest.param(status_text(), True, True, "", id="root-with-every-capability"),
        pytest.param(
            status_text(cap_eff=CAPS_KILL_ONLY),
            True,
            False,
            "",
            id="the-charts-kill-only",
        ),
        pytest.param(
            status_text(uid=65534, cap_eff=CAPS_KILL_ONLY),
            True,
            False,
            "",
            id="non-root-with-ambient-kill",
        ),
        pytest.param(
            status_text(cap_eff=CAPS_KILL_PTRACE_DAC_READ_SEARCH),
            True,
            True,
            "",
            id="kill-ptrace-dac-read-search",
        ),
        pytest.param(
            status_text(uid=65534, cap_eff=CAPS_NONE),
            False,
            False,
            "CapEff 0000000000000000 (uid 65534) lacks CAP_KILL",
            id="nobody-without-capabilities",
        ),
        pytest.param(
            status_text(uid=0, cap_eff=CAPS_DOCKER_DEFAULT_NO_KILL),
            False,
            False,
            "root only in name",
            id="root-without-cap-kill",
        ),
        pytest.param(
            status_text(cap_eff=None), False, False, "has no CapEff line", id="missing-line"
        ),
        pytest.param(status_text(cap_eff="zz20"), False, False, "'zz20'", id="not-hex"),
        pytest.param(status_text(cap_eff="0x20"), False, False, "'0x20'", id="hex-prefix"),
        pytest.param(status_text(cap_eff="0_20"), False, False, "'0_20'", id="underscore"),
        pytest.param(status_text(cap_eff=""), False, False, "''", id="empty"),
        pytest.param(
            status_text(cap_eff="1" + CAPS_ALL), False, False, "'1000001ffffffffff'", id="too-long"
        ),
    ],
)
def test_the_privilege_check_decides_on_the_effective_capabilities(
    tmp_path: Path, status: str, can_signal: bool, reads_gpu_files: bool, says: str
) -> None:
    check = check_privileges(status_file(tmp_path, status))

    assert (check.can_signal, check.reads_gpu_files) == (can_signal, reads_gpu_files)
    assert check.reason == (None if can_signal else "cannot_signal")
    assert says in check.detail


def test_an_unreadable_status_file_cannot_signal(tmp_path: Path) -> None:
    check = check_privileges(tmp_path / "no-such-status")

    assert (check.can_signal, check.reason) == (False, "cannot_signal")
    assert "cannot read" in check.detail


def test_the_real_process_can_signal_when_it_holds_cap_kill() -> None:
    # Independent oracle: capget(2)'s view through the shell's own /proc/<pid>/status.
    status = Path(f"/proc/{os.getpid()}/status").read_text()
    effective = int(next(ln for ln in status.splitlines() if ln.startswith("CapEff:"))[7:], 16)
    require(bool(effective & (1 << 5)), "the test runner lacks CAP_KILL")

    check = check_privileges()

    assert (check.can_signal, check.reason) == (True, None)


def test_a_proc_root_whose_pid_1_cannot_be_read_is_named(tmp_path: Path) -> None:
    """/proc mounted with hidepid (or a proc_root that is no /proc) hides other users'
    processes: every GPU process would then be a ghost, attributed to no pod."""
    assert check_proc_readable(Path("/proc")) is None
    assert check_proc_readable(tmp_path) == (
        f"{tmp_path}/1/stat is missing (no PID 1: hidepid, or not the host's /proc)"
    )
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "stat").write_text("1 (init) S " + "0 " * 18 + "42 0\n")
    (tmp_path / "1" / "cgroup").symlink_to("/proc/self/cgroup")
    problem = check_proc_readable(tmp_path)
    assert problem is not None
    assert problem.startswith(f"cannot read {tmp_path}/1/cgroup (")


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
NO_CAPABILITIES = ["--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all"]


def _readable_copies(stub_lib: Path, work: Path) -> tuple[Path, Path, Path, Path]:
    """Hard-linked copies (plain copies across file systems) under ``work`` of the virtualenv,
    the ``gpuguard`` package, the NVML stand-in and the pods file: the interpreter, the
    ``PYTHONPATH`` entry, the library and the pods file to hand uid 65534."""
    repo = Path(__file__).resolve().parents[1]
    venv = Path(sys.prefix)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    skip = shutil.ignore_patterns("__pycache__")
    python = Path(sys.executable)
    if sys.prefix != sys.base_prefix:  # a virtualenv: its site-packages live in the checkout
        shutil.copytree(venv, work / "venv", symlinks=True, copy_function=link, ignore=skip)
        (work / "venv").chmod(0o755)
        python = work / "venv" / python.relative_to(venv)
    shutil.copytree(repo / "gpuguard", work / "src" / "gpuguard", copy_function=link, ignore=skip)
    (work / "src").chmod(0o755)
    lib = work / stub_lib.name
    link(str(stub_lib), str(lib))
    pods = work / POD_FILE.name
    link(str(POD_FILE), str(pods))
    return python, work / "src", lib, pods


@pytest.mark.kernel
@pytest.mark.nvml_stub
def test_a_real_enforcer_without_cap_kill_is_not_ready_and_says_why_once(
    stub_lib: Path,
) -> None:
    """The real ``gpuguard enforce`` as uid 65534 without capabilities, in enforce mode, over
    the NVML stand-in and a pods file: it cannot signal any pod's process, so it must not say
    it enforces (it did: ready, ``enforcement_active{reason=""} 1``, no warning)."""
    require(os.geteuid() == 0, "setpriv --reuid needs root")
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) not installed")
    env = environ_without_gpuguard_settings()
    with tempfile.TemporaryDirectory(prefix="gpuguard-nobody-") as tmp:
        work = Path(tmp)
        work.chmod(0o777)  # uid 65534 reads the scenario and writes the node lock here
        # A checkout may sit in a directory only root can enter (`git clone` into `mktemp -d`,
        # mode 0700): uid 65534 runs linked copies of what it needs from a directory it can read.
        python, source, lib, pods = _readable_copies(stub_lib, work)
        env |= {"PYTHONPATH": str(source), "PYTHONDONTWRITEBYTECODE": "1"}
        as_nobody = [*NOBODY, *NO_CAPABILITIES, str(python)]
        probe = subprocess.run(
            [*as_nobody, "-c", "import gpuguard.cli"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert probe.returncode == 0, f"uid 65534 cannot run {python}: {probe.stderr[-300:]}"
        scenario = Scenario(work / "scenario.json")
        scenario.write({"devices": [nvml_gpu(0)]})
        port = free_port()
        env |= {
            SCENARIO_ENV: str(scenario.path),
            "GPUGUARD_NVML_LIBRARY_PATH": str(lib),
            "GPUGUARD_ENFORCEMENT_LOCK_FILE": str(work / "enforcer.lock"),
        }
        argv = ["enforce", "--mode", "enforce", "--node-name", "n", "--pods-file", str(pods)]
        argv += ["--metrics-address", f"127.0.0.1:{port}", "--log-format", "json"]
        log_path = work / "enforcer.log"
        with log_path.open("wb") as out:
            enforcer = subprocess.Popen(
                [*as_nobody, "-m", "gpuguard.cli", *argv],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            readyz = _wait_for_a_poll(enforcer, port, log_path)
            metrics = http_get(port, "/metrics", timeout=3)[1]
        finally:
            enforcer.terminate()
            enforcer.wait(15)
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]

    assert enforcer.returncode == 0, log_path
    code, body = readyz
    assert code == 503
    assert body.startswith("not ready: cannot_signal: CapEff 0000000000000000 (uid 65534)")
    active = [x for x in metrics.splitlines() if x.startswith("gpuguard_enforcement_active{")]
    assert len(active) == 1
    assert active[0].startswith('gpuguard_enforcement_active{reason="cannot_signal: CapEff')
    assert active[0].endswith(" 0.0")
    loud = [x for x in lines if x.get("level") in ("warning", "error", "critical")]
    assert [(x["event"], x["reason"]) for x in loud] == [("enforcement_refused", "cannot_signal")]
    assert "CAP_KILL" in loud[0]["detail"]
    assert "add: [KILL]" in loud[0]["fix"]


def _wait_for_a_poll(
    enforcer: subprocess.Popen[bytes], port: int, log_path: Path
) -> tuple[int, str]:
    """``/readyz`` once a poll has finished (before that it says so), or fail with the log."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert enforcer.poll() is None, log_path.read_text()[-4000:]
        try:
            code, body = http_get(port, "/readyz", timeout=3)
        except OSError:
            code, body = 0, ""
        if code and "no poll finished yet" not in body:
            return code, body.strip()
        time.sleep(0.1)
    pytest.fail(f"no poll within 30 s:\n{log_path.read_text()[-4000:]}")


SEES_GPU_FILES = (
    "import json, sys; from pathlib import Path; "
    "from gpuguard.adapters.procfs import ProcfsProcessResolver; "
    "from gpuguard.adapters.selfcheck import check_privileges; "
    "a = ProcfsProcessResolver(Path('/proc'), check_gpu_fds=True).attribute(int(sys.argv[1])); "
    "print(json.dumps({'holds_gpu': a.holds_gpu, 'says': check_privileges().reads_gpu_files}))"
)


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("caps", "readable"),
    [
        pytest.param("+kill", False, id="the-charts-kill-only"),
        pytest.param("+kill,+sys_ptrace", False, id="ptrace-without-dac"),
        pytest.param("+kill,+dac_read_search", False, id="dac-without-ptrace"),
        pytest.param("+kill,+sys_ptrace,+dac_read_search", True, id="ptrace-and-dac"),
    ],
)
def test_another_users_gpu_files_are_readable_exactly_when_the_check_says_so(
    caps: str, readable: bool
) -> None:
    """The rule ``reads_gpu_files`` encodes, against the real kernel: root with the given
    capabilities only looks into the ``fd`` directory of a uid 1000 process (which holds no
    GPU file: ``False`` when readable, unknown ``None`` when not)."""
    require(os.geteuid() == 0, "setpriv needs root")
    require(shutil.which("setpriv") is not None, "setpriv (util-linux) not installed")
    repo = Path(__file__).resolve().parents[1]
    victim = subprocess.Popen(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "60"]
    )
    try:
        deadline = time.monotonic() + 5
        while "Uid:\t1000" not in Path(f"/proc/{victim.pid}/status").read_text():
            assert time.monotonic() < deadline, "the victim never became uid 1000"
            time.sleep(0.01)
        only_caps = ["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}"]
        out = subprocess.run(
            [*only_caps, sys.executable, "-c", SEES_GPU_FILES, str(victim.pid)],
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        victim.kill()
        victim.wait()
    result = json.loads(out.stdout)

    assert result == {"holds_gpu": False if readable else None, "says": readable}


@pytest.mark.parametrize(
    ("mode", "namespace_mode", "blocked", "event", "level"),
    [
        pytest.param(Mode.ENFORCE, None, True, "enforcement_refused", "error", id="enforce"),
        pytest.param(
            Mode.AUDIT, None, False, "enforcement_would_be_refused", "warning", id="audit"
        ),
        pytest.param(
            Mode.AUDIT,
            Mode.ENFORCE,
            True,
            "enforcement_refused",
            "error",
            id="audit-but-one-namespace-enforces",
        ),
        pytest.param(
            Mode.ENFORCE,
            Mode.AUDIT,
            True,
            "enforcement_refused",
            "error",
            id="enforce-but-one-namespace-audits",
        ),
    ],
)
def test_without_cap_kill_only_a_mode_that_would_signal_is_blocked(
    tmp_path: Path,
    mode: Mode,
    namespace_mode: Mode | None,
    blocked: bool,
    event: str,
    level: str,
) -> None:
    """Audit mode signals nothing, so it keeps running ready, and says what enforce mode
    would do; any namespace in enforce mode blocks, with one line that names the fix."""
    privileges = check_privileges(status_file(tmp_path, status_text(cap_eff=CAPS_NONE)))
    namespaces = {} if namespace_mode is None else {"team-a": NamespacePolicy(mode=namespace_mode)}
    policy = EnforcementPolicy(mode=mode, limits=LimitPolicy(namespaces=namespaces))

    with capture_logs() as logs:
        refusal = refuse_without_privileges(privileges, policy, Path("/proc"))

    if blocked:
        assert refusal is not None
        assert (refusal.reason, refusal.detail) == (RefusalReason.CANNOT_SIGNAL, privileges.detail)
    else:
        assert refusal is None
    loud = [e for e in logs if e["log_level"] in ("warning", "error")]
    assert [(e["event"], e["log_level"], e["reason"]) for e in loud] == [
        (event, level, "cannot_signal")
    ]
    assert "add: [KILL]" in loud[0]["fix"]


def test_with_cap_kill_nothing_is_blocked_or_warned(tmp_path: Path) -> None:
    privileges = check_privileges(status_file(tmp_path, status_text(cap_eff=CAPS_KILL_ONLY)))

    with capture_logs() as logs:
        refusal = refuse_without_privileges(
            privileges, EnforcementPolicy(mode=Mode.ENFORCE), Path("/proc")
        )

    assert refusal is None
    assert [(e["event"], e["log_level"]) for e in logs] == [("gpu_files_unreadable", "info")]
