"""The ``nvidia`` runtime stand-in (rigs/kubelet/nvidia-container-runtime) run as containerd's runc
shim would run it, against real bundle directories and a fake runc that records what it was given;
and the pure parts of rigs/kubelet/gpu.py (device IDs, allocation, the containerd TOML).

No root needed: the stand-in device nodes here are symlinks to /dev/null (the runtime follows
them, as it follows a real node's path), except in the mknod test, which needs root.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rigs.kubelet import gpu
from rigs.prereq import require

FAKE_RUNC = """\
import json, os, sys
from pathlib import Path
record = {"argv": sys.argv[1:], "cwd": os.getcwd()}
for i, a in enumerate(sys.argv):
    if a in ("--bundle", "-b"):
        record["config"] = json.loads((Path(sys.argv[i + 1]) / "config.json").read_text())
with open(os.environ["FAKE_RUNC_RECORD"], "a") as f:
    f.write(json.dumps(record) + "\\n")
sys.exit(int(os.environ.get("FAKE_RUNC_EXIT", "0")))
"""
U0 = "GPU-00000000-aaaa-4000-8000-000000000000"
U1 = "GPU-00000001-aaaa-4000-8000-000000000000"
NULL = os.stat("/dev/null")


class Rig:
    def __init__(self, tmp: Path, gpu_uuids: list[str] | None = None) -> None:
        self.tmp = tmp
        self.record = tmp / "runc-calls.jsonl"
        runc = tmp / "runc"
        runc.write_text(f"#!{sys.executable}\n{FAKE_RUNC}")
        runc.chmod(0o755)
        library = tmp / "libnvidia-ml.so.1"
        library.write_bytes(b"\x7fELF stand-in")
        self.scenario_dir = tmp / "nvml"
        self.scenario_dir.mkdir()
        (self.scenario_dir / "scenario.json").write_text(
            json.dumps({"devices": [{"uuid": U0}, {"uuid": U1}]})
        )
        self.dev_dir = tmp / "dev"
        self.dev_dir.mkdir()
        for name in gpu.device_node_names(2):
            (self.dev_dir / name).symlink_to("/dev/null")
        self.log = tmp / "runtime.jsonl"
        self.shim = gpu.install_runtime(
            tmp / "rt",
            runc=runc,
            library=library,
            scenario_dir=self.scenario_dir,
            dev_dir=self.dev_dir,
            gpu_uuids=gpu_uuids,
            log=self.log,
        )
        self.library = library

    def bundle(self, env: list[str], **extra: Any) -> Path:
        bundle = self.tmp / "bundle"
        bundle.mkdir(exist_ok=True)
        spec = {
            "ociVersion": "1.2.0",
            "process": {"args": ["python3"], "env": env, "cwd": "/"},
            "root": {"path": "rootfs", "readonly": True},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"resources": {"devices": [{"allow": False, "access": "rwm"}]}},
            **extra,
        }
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle

    def run(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.shim), *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "FAKE_RUNC_RECORD": str(self.record), **(env or {})},
            check=False,
        )

    def calls(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def actions(self) -> list[str]:
        return [json.loads(line)["action"] for line in self.log.read_text().splitlines()]


def create_args(bundle: Path, runc_log: Path | None = None) -> list[str]:
    log = ["--log", str(runc_log), "--log-format", "json"] if runc_log else []
    return [
        "--root",
        "/tmp/runc-root",
        *log,
        "create",
        "--bundle",
        str(bundle),
        "--pid-file",
        str(bundle / "init.pid"),
        "ctr-1",
    ]


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


def null_device(path: str) -> dict[str, Any]:
    return {
        "path": path,
        "type": "c",
        "major": os.major(NULL.st_rdev),
        "minor": os.minor(NULL.st_rdev),
        "fileMode": stat.S_IMODE(NULL.st_mode),
        "uid": 0,
        "gid": 0,
    }


def test_passes_every_other_command_through_unchanged(rig: Rig) -> None:
    bundle = rig.bundle(["NVIDIA_VISIBLE_DEVICES=all"])
    before = (bundle / "config.json").read_bytes()
    commands = [
        ["--root", "/r", "--log", "/l.json", "--log-format", "json", "start", "ctr-1"],
        ["--root=/r", "state", "ctr-1"],
        ["--root", "/r", "kill", "ctr-1", "9"],
        ["--root", "/r", "delete", "--force", "ctr-1"],
        ["--version"],
        ["features"],
    ]
    for args in commands:
        assert rig.run(*args).returncode == 0
    assert [c["argv"] for c in rig.calls()] == commands
    assert (bundle / "config.json").read_bytes() == before
    assert rig.actions() == ["passthrough"] * len(commands)


def test_runc_exit_status_is_runcs(rig: Rig) -> None:
    result = rig.run("--root", "/r", "state", "gone", env={"FAKE_RUNC_EXIT": "3"})
    assert result.returncode == 3


def test_injects_library_scenario_and_all_devices(rig: Rig) -> None:
    bundle = rig.bundle(["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "NVML_STUB_SCENARIO=/x"])
    args = create_args(bundle)
    result = rig.run(*args)
    assert result.returncode == 0, result.stderr
    [call] = rig.calls()
    assert call["argv"] == args  # runc gets every argument, in order
    spec = json.loads((bundle / "config.json").read_text())
    assert call["config"] == spec  # and the edited bundle
    assert spec["mounts"][1:] == [
        {
            "destination": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
            "type": "bind",
            "source": str(rig.library),
            "options": ["ro", "nosuid", "nodev", "bind"],
        },
        {
            "destination": "/run/nvml-stub",
            "type": "bind",
            "source": str(rig.scenario_dir),
            "options": ["ro", "nosuid", "nodev", "noexec", "rbind"],
        },
    ]
    assert spec["process"]["env"] == [
        "PATH=/usr/bin",
        "NVIDIA_VISIBLE_DEVICES=all",
        "NVML_STUB_SCENARIO=/run/nvml-stub/scenario.json",
    ]
    paths = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert spec["linux"]["devices"] == [null_device(p) for p in paths]
    rule = {
        "allow": True,
        "type": "c",
        "major": os.major(NULL.st_rdev),
        "minor": os.minor(NULL.st_rdev),
        "access": "rwm",
    }
    assert spec["linux"]["resources"]["devices"] == [{"allow": False, "access": "rwm"}, rule]
    assert rig.actions() == ["injected"]


def test_uuid_list_from_the_scenario_and_devices_already_listed(rig: Rig) -> None:
    listed = {**null_device("/dev/nvidiactl"), "fileMode": 0o600}  # from the device plugin
    bundle = rig.bundle([f"NVIDIA_VISIBLE_DEVICES={U1}"], linux={"devices": [listed]})
    assert rig.run(*create_args(bundle)).returncode == 0
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["linux"]["devices"] == [
        listed,
        null_device("/dev/nvidia1"),
        null_device("/dev/nvidia-uvm"),
    ]


def test_uuids_from_the_config_and_indices(tmp_path: Path) -> None:
    rig = Rig(tmp_path, gpu_uuids=[U1, U0])  # the config's order wins over the scenario's
    bundle = rig.bundle([f"NVIDIA_VISIBLE_DEVICES={U0},0"])
    assert rig.run("create", "-b", str(bundle), "c").returncode == 0
    devices = json.loads((bundle / "config.json").read_text())["linux"]["devices"]
    assert [d["path"] for d in devices] == [
        "/dev/nvidia1",
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]


def test_none_brings_the_library_without_devices(rig: Rig) -> None:
    bundle = rig.bundle(["NVIDIA_VISIBLE_DEVICES=none"])
    assert rig.run(*create_args(bundle)).returncode == 0
    spec = json.loads((bundle / "config.json").read_text())
    assert len(spec["mounts"]) == 3
    assert "devices" not in spec["linux"]


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES="], ["NVIDIA_VISIBLE_DEVICES=void"]])
def test_no_injection_without_visible_devices(rig: Rig, env: list[str]) -> None:
    bundle = rig.bundle(["PATH=/bin", *env])
    before = (bundle / "config.json").read_bytes()
    cwd_create = ["--root", "/r", "create", "--pid-file", "p", "ctr"]  # bundle: the cwd
    result = subprocess.run(
        [str(rig.shim), *cwd_create],
        cwd=bundle,
        capture_output=True,
        text=True,
        timeout=30,
        env={"FAKE_RUNC_RECORD": str(rig.record)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (bundle / "config.json").read_bytes() == before
    assert [c["argv"] for c in rig.calls()] == [cwd_create]
    assert rig.actions() == ["unchanged"]


def refused(rig: Rig, bundle: Path, message: str) -> None:
    runc_log = rig.tmp / "runc-log.json"
    result = rig.run(*create_args(bundle, runc_log))
    assert result.returncode == 1
    assert message in result.stderr
    assert rig.calls() == []  # runc never ran
    [entry] = [json.loads(line) for line in runc_log.read_text().splitlines()]
    assert entry["level"] == "error"
    assert message in entry["msg"]
    assert rig.actions() == ["refused"]


def test_malformed_config_json_is_refused(rig: Rig) -> None:
    bundle = rig.bundle([])
    (bundle / "config.json").write_text('{"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]')
    refused(rig, bundle, "malformed JSON")


def test_config_json_of_the_wrong_shape_is_refused(rig: Rig) -> None:
    bundle = rig.bundle([])
    (bundle / "config.json").write_text('{"process": {"env": "NVIDIA_VISIBLE_DEVICES=all"}}')
    refused(rig, bundle, "process.env is not a list of strings")


def test_oversized_config_json_is_refused(rig: Rig) -> None:
    bundle = rig.bundle(["NVIDIA_VISIBLE_DEVICES=all", "PAD=" + "x" * (4 << 20)])
    refused(rig, bundle, "larger than 4194304 bytes")


def test_unknown_device_is_refused(rig: Rig) -> None:
    bundle = rig.bundle(["NVIDIA_VISIBLE_DEVICES=GPU-not-here"])
    refused(rig, bundle, "unknown device 'GPU-not-here'")


def test_a_missing_device_node_is_refused(rig: Rig) -> None:
    (rig.dev_dir / "nvidia-uvm").unlink()
    refused(rig, rig.bundle(["NVIDIA_VISIBLE_DEVICES=0"]), "nvidia-uvm")


def test_bad_runtime_config_is_refused(rig: Rig) -> None:
    config = rig.shim.with_name(rig.shim.name + ".json")
    config.write_text(json.dumps({**json.loads(config.read_text()), "runC": "/typo"}))
    result = rig.run("state", "x")
    assert result.returncode == 1
    assert "unknown keys ['runC']" in result.stderr
    assert rig.calls() == []


def test_the_config_file_can_be_named_by_env(rig: Rig, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.json"
    other.write_text("[]")
    result = rig.run("state", "x", env={"GPUGUARD_NVIDIA_RUNTIME_CONFIG": str(other)})
    assert result.returncode == 1
    assert "not a JSON object" in result.stderr


# ---------------------------------------------------------------------------------------------
# rigs/kubelet/gpu.py


def test_advertised_device_ids_follow_nvidias_plugin() -> None:
    assert gpu.advertised_device_ids([U0, U1], 1) == [U0, U1]
    assert gpu.advertised_device_ids([U0, U1], 2) == [
        f"{U0}::0",
        f"{U0}::1",
        f"{U1}::0",
        f"{U1}::1",
    ]


def test_default_uuids_are_the_h200x8_scenarios() -> None:
    scenario = Path(__file__).parents[1] / "nvml_stub" / "scenarios" / "h200x8.json"
    uuids = [d["uuid"] for d in json.loads(scenario.read_text())["devices"]]
    assert gpu.gpu_uuids(8) == uuids


def test_uuid_flags_round_trip() -> None:
    one = "GPU-5eb3a1a0-0000-4000-8000-000000000000"
    assert gpu.gpu_uuids(1, *gpu.uuid_flags([one])) == [one]
    assert gpu.uuid_flags([U0, U1]) == ("GPU-", "-aaaa-4000-8000-000000000000")
    with pytest.raises(ValueError, match="<prefix><i as %08d><suffix>"):
        gpu.uuid_flags(["GPU-8f2c1d90-3e5a-4b17-9c2e-5da9abb51763"])


def test_device_plugin_argv(tmp_path: Path) -> None:
    argv = gpu.device_plugin_argv(
        Path("/bin/gpu-device-plugin"), dev_dir=tmp_path, uuids=[U0, U1], replicas=4
    )
    assert argv == [
        "/bin/gpu-device-plugin",
        "--kubelet-socket=/var/lib/kubelet/device-plugins/kubelet.sock",
        "--plugin-dir=/var/lib/kubelet/device-plugins",
        "--endpoint=gpuguard-test-gpu.sock",
        "--resource=nvidia.com/gpu",
        "--gpus=2",
        "--replicas=4",
        "--uuid-prefix=GPU-",
        "--uuid-suffix=-aaaa-4000-8000-000000000000",
        f"--dev-dir={tmp_path}",
    ]


def test_allocation() -> None:
    env, specs = gpu.allocation([f"{U1}::2", f"{U0}::0", f"{U1}::1"], [U0, U1], Path("/d"))
    assert env == {"NVIDIA_VISIBLE_DEVICES": f"{U1},{U0}"}
    assert specs == [
        ("/dev/nvidia1", "/d/nvidia1", "rw"),
        ("/dev/nvidia0", "/d/nvidia0", "rw"),
        ("/dev/nvidiactl", "/d/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/d/nvidia-uvm", "rw"),
    ]


def test_containerd_runtime_toml(tmp_path: Path) -> None:
    shim = tmp_path / "rt" / "nvidia-container-runtime"
    doc = tomllib.loads("version = 3\n" + gpu.containerd_runtime_toml(shim))
    runtimes = doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    assert runtimes == {
        "nvidia": {
            "runtime_type": "io.containerd.runc.v2",
            "disable_pause_image_pull": True,
            "options": {
                "BinaryName": str(shim),
                "Root": str(tmp_path / "rt" / "runc-nvidia"),
                "SystemdCgroup": False,
            },
        }
    }


def test_make_device_nodes(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "mknod needs root (CAP_MKNOD)")
    made = gpu.make_device_nodes(tmp_path / "dev", 2)
    assert [p.name for p in made] == ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"]
    for path in made:
        st = os.lstat(path)
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
        assert stat.S_IMODE(st.st_mode) == 0o666
    fd = os.open(made[0], os.O_RDWR)  # a tenant can open and hold it
    try:
        assert os.write(fd, b"x") == 1
    finally:
        os.close(fd)
    assert gpu.make_device_nodes(tmp_path / "dev", 2) == made  # idempotent
    (tmp_path / "dev" / "nvidia2").write_text("not a device")
    with pytest.raises(FileExistsError, match="not a c 1 3 device node"):
        gpu.make_device_nodes(tmp_path / "dev", 3)
