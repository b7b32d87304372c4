"""gpuguard.config: the Settings tree, its sources and precedence, and its error reporting."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpuguard.config import (
    SECTIONS,
    AgentSettings,
    LogFormat,
    NamespaceSettings,
    Settings,
    checker_rules,
    env_var,
    load_settings,
    settable_keys,
)
from gpuguard.core.limits import percent_below_minimum
from gpuguard.core.model import (
    EnforcementPolicy,
    GpuUuid,
    LimitPolicy,
    LimitValue,
    Mode,
    NamespacePolicy,
    PodUid,
)
from gpuguard.errors import ConfigError
from tests.config_cases import BAD_CONFIGS, BadConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config.example.toml"
FIXTURES = Path(__file__).parent / "fixtures" / "config"
GI = 1 << 30


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(
    *,
    config_path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> list[str]:
    """What ``load_settings`` reports, with an empty environment unless one is given."""
    with pytest.raises(ConfigError) as caught:
        load_settings(
            config_path=config_path,
            environ={} if environ is None else environ,
            overrides=overrides,
        )
    return caught.value.problems


# --- defaults and the example file -----------------------------------------------------------


def test_defaults_are_audit_mode_fast_path_and_pressure_with_only_kube_system_exempt() -> None:
    settings = load_settings(environ={})
    assert settings == Settings()
    assert settings.enforcement.mode is Mode.AUDIT
    # A memory read every 50 ms, a listing at the latest every second, pressure below 5 %.
    assert settings.enforcement.fast_interval_seconds == 0.05
    assert settings.enforcement.poll_interval_seconds == 1.0
    assert settings.enforcement.fast_step_bytes == 64 * 2**20
    assert settings.enforcement.pressure_free_fraction == 0.05
    assert settings.node.name is None
    assert settings.node.proc_root == Path("/proc")
    # Only a name no tenant can create: NVIDIA's namespaces are exempted by the admin's label.
    assert settings.limits.exempt_namespaces == frozenset({"kube-system"})
    assert settings.limits.exempt_namespace_label == ""
    assert settings.logging.format is LogFormat.AUTO


def test_the_example_file_loads_and_states_every_default() -> None:
    settings = load_settings(config_path=EXAMPLE, environ={})
    example_namespace = NamespaceSettings(
        default=LimitValue(limit_bytes=8 * GI), max=LimitValue(limit_bytes=40 * GI), mode=Mode.AUDIT
    )
    expected = dataclasses.replace(
        Settings(),
        limits=dataclasses.replace(
            Settings().limits, namespaces={"team-onboarding": example_namespace}
        ),
    )
    assert settings == expected


def test_the_example_file_and_the_settings_tree_have_the_same_keys() -> None:
    example = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    assert list(example) == ["version", *SECTIONS]
    for section, cls in SECTIONS.items():
        assert set(example[section]) == {f.name for f in dataclasses.fields(cls)}, section
    for table in example["limits"]["namespaces"].values():
        assert set(table) == {f.name for f in dataclasses.fields(NamespaceSettings)}
    assert [f.name for f in dataclasses.fields(Settings)] == list(SECTIONS)


def test_every_setting_has_a_docstring_and_every_example_key_a_comment() -> None:
    source = Path(inspect.getfile(Settings)).read_text(encoding="utf-8")
    documented: dict[str, set[str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        names = documented.setdefault(node.name, set())
        for field_node, after in zip(node.body, [*node.body[1:], None], strict=True):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                names.add(field_node.target.id)
    for cls in [*SECTIONS.values(), NamespaceSettings]:
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields <= documented[cls.__name__], cls.__name__
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if "=" in line and not line.startswith(("#", "[", "version")):
            assert lines[number - 1].startswith("#"), f"undocumented example key: {line}"


# --- sources and precedence -------------------------------------------------------------------


def test_file_overrides_defaults_env_overrides_file_and_flags_override_env(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        'version = 1\n[enforcement]\nmode = "enforce"\ngrace_seconds = 5\n'
        "poll_interval_seconds = 0.5\n",
    )
    settings = load_settings(
        config_path=path,
        environ={
            "GPUGUARD_ENFORCEMENT_GRACE_SECONDS": "7.5",
            "GPUGUARD_ENFORCEMENT_POLL_INTERVAL_SECONDS": "1",
        },
        overrides={"enforcement.poll_interval_seconds": 2.0},
    )
    assert settings.enforcement.mode is Mode.ENFORCE  # file
    assert settings.enforcement.grace_seconds == 7.5  # env over file
    assert settings.enforcement.poll_interval_seconds == 2.0  # flag over env
    assert settings.enforcement.termination_timeout_seconds == 10.0  # default


def test_env_variable_names_are_section_and_key_upper_cased() -> None:
    assert env_var("node", "name") == "GPUGUARD_NODE_NAME"
    assert env_var("enforcement", "mode") == "GPUGUARD_ENFORCEMENT_MODE"
    environ = {
        env_var("enforcement", "mode"): "enforce",
        env_var("limits", "exempt_namespaces"): "kube-system, team-x",
        env_var("limits", "replicas_default"): "TRUE",
        env_var("limits", "default"): "25%",
        env_var("nvml", "fail_on_init_error"): "no",
        env_var("nvml", "library_path"): "/host/lib/libnvidia-ml.so.1",
        env_var("metrics", "address"): "[::]:9410",
        env_var("logging", "level"): "debug",
    }
    settings = load_settings(environ=environ)
    assert settings.enforcement.mode is Mode.ENFORCE
    assert settings.limits.exempt_namespaces == frozenset({"kube-system", "team-x"})
    assert settings.limits.replicas_default is True
    assert settings.limits.default == LimitValue(percent=25.0)
    assert settings.nvml.fail_on_init_error is False
    assert settings.nvml.library_path == Path("/host/lib/libnvidia-ml.so.1")
    assert settings.metrics.address == "[::]:9410"


def test_every_settable_key_has_a_working_env_variable() -> None:
    assert ("limits", "namespaces") not in settable_keys()
    for section, key in settable_keys():
        name = env_var(section, key)
        with pytest.raises(ConfigError) as caught:
            load_settings(environ={name: "\0bad"})
        assert caught.value.problems[0].startswith(f"env {name}: {section}.{key} = ")


def test_node_name_falls_back_to_the_downward_api_variable() -> None:
    assert load_settings(environ={"NODE_NAME": "gpu-node-1"}).node.name == "gpu-node-1"
    both = {"NODE_NAME": "gpu-node-1", "GPUGUARD_NODE_NAME": "gpu-node-2"}
    assert load_settings(environ=both).node.name == "gpu-node-2"
    assert load_settings(environ={"NODE_NAME": ""}).node.name is None


def test_empty_env_values_count_as_unset() -> None:
    settings = load_settings(environ={"GPUGUARD_ENFORCEMENT_MODE": "", "GPUGUARD_NODE_NAME": ""})
    assert settings == Settings()


def test_config_path_comes_from_gpuguard_config_when_not_given(tmp_path: Path) -> None:
    path = write(tmp_path, 'version = 1\n[enforcement]\nmode = "enforce"\n')
    settings = load_settings(environ={"GPUGUARD_CONFIG": str(path)})
    assert settings.enforcement.mode is Mode.ENFORCE
    explicit = write(tmp_path, "version = 1\n", "other.toml")
    assert load_settings(config_path=explicit, environ={"GPUGUARD_CONFIG": str(path)}) == Settings()


def test_kubelet_service_link_variables_are_ignored() -> None:
    environ = {
        "GPUGUARD_SERVICE_HOST": "10.0.0.1",
        "GPUGUARD_SERVICE_PORT": "9410",
        "GPUGUARD_SERVICE_PORT_METRICS": "9410",
        "GPUGUARD_PORT": "tcp://10.0.0.1:9410",
        "GPUGUARD_PORT_9410_TCP": "tcp://10.0.0.1:9410",
        "GPUGUARD_PORT_9410_TCP_PROTO": "tcp",
        "GPUGUARD_PORT_9410_TCP_PORT": "9410",
        "GPUGUARD_PORT_9410_TCP_ADDR": "10.0.0.1",
        "GPUGUARD_METRICS_SERVICE_HOST": "10.0.0.2",
    }
    assert load_settings(environ=environ) == Settings()


def test_process_environment_is_read_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("GPUGUARD_") or name == "NODE_NAME":
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUGUARD_ENFORCEMENT_MODE", "enforce")
    assert load_settings().enforcement.mode is Mode.ENFORCE


def test_overrides_accept_strings_like_env_values() -> None:
    settings = load_settings(
        environ={},
        overrides={
            "enforcement.mode": "enforce",
            "node.name": "n1",
            "node.proc_root": "/host/proc",
            "kube.kubeconfig": "/root/.kube/config",
            "logging.format": "json",
        },
    )
    assert settings.enforcement.mode is Mode.ENFORCE
    assert settings.node.proc_root == Path("/host/proc")
    assert settings.kube.kubeconfig == Path("/root/.kube/config")


# --- the policy the core sees -----------------------------------------------------------------


def test_enforcement_policy_carries_the_admin_policy_and_own_pod() -> None:
    settings = load_settings(config_path=FIXTURES / "production.toml", environ={})
    policy = settings.enforcement_policy(self_pod_uid=PodUid("self"))
    assert policy == EnforcementPolicy(
        mode=Mode.ENFORCE,
        grace_seconds=5.0,
        termination_timeout_seconds=10.0,
        staleness_seconds=30.0,
        limits=LimitPolicy(
            cluster_default=LimitValue(percent=25.0),
            namespaces={
                "research": NamespacePolicy(
                    default_limit=LimitValue(limit_bytes=40 * GI),
                    max_limit=LimitValue(limit_bytes=60 * GI),
                ),
                "onboarding": NamespacePolicy(mode=Mode.AUDIT),
            },
            replicas_default=True,
            replicas_reserve_bytes=2 * GI,
            exempt_namespaces=frozenset({"kube-system", "gpu-operator", "monitoring"}),
        ),
        self_pod_uid=PodUid("self"),
    )


def test_resolved_settings_render_as_json_for_the_startup_log() -> None:
    import json

    rendered = load_settings(config_path=FIXTURES / "production.toml", environ={}).to_dict()
    assert json.loads(json.dumps(rendered)) == rendered
    assert rendered["limits"]["default"] == "25%"
    assert rendered["limits"]["namespaces"]["research"]["max"] == 60 * GI


# --- errors: all at once, each naming source, key, value and what is allowed ------------------


def test_reports_every_problem_of_a_file_at_once() -> None:
    path = FIXTURES / "many-problems.toml"
    problems = problems_of(config_path=path)
    expected = [
        f'{path}: enforcement.mode = "kill": must be one of "enforce", "audit"',
        f"{path}: enforcement.grace_seconds = -1: must be a number ≥ 0 (seconds)",
        f'{path}: enforcement.poll_interval_seconds = "fast": must be a number > 0 (seconds)',
        f'{path}: limits.exempt_namespaces = "kube-system": must be a list of namespace names',
        f'{path}: limits.replicas_reserve_bytes = "10%": is a percentage, not allowed here',
        f"{path}: [limits.namespaces.Team_A]: 'Team_A' is not a namespace name",
        f"{path}: limits.namespaces.team-b.default is above limits.namespaces.team-b.max",
        f"{path}: unknown key limits.namespaces.team-b.maximum: did you mean "
        "limits.namespaces.team-b.max? (allowed: default, max, mode)",
        f"{path}: unknown key metrics.adress: did you mean metrics.address? (allowed in "
        "[metrics]: address)",
        f"{path}: unknown key telemetry (allowed: version and the sections [node]",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert any(
        p.startswith(f'{path}: limits.default = "8GB": has an unknown unit') for p in problems
    )
    assert "did you mean 8Gi or 8G?" in " ".join(problems)
    assert len(problems) == len(expected) + 1
    message = str(ConfigError(problems))
    assert message.startswith("invalid configuration:\n  - ")


def test_a_toml_syntax_error_names_the_file_and_line() -> None:
    path = FIXTURES / "syntax-error.toml"
    (problem,) = problems_of(config_path=path)
    assert problem.startswith(f"{path}: TOML syntax error: ")
    assert "line 5" in problem


def test_a_missing_or_unknown_version_is_an_error() -> None:
    (missing,) = problems_of(config_path=FIXTURES / "no-version.toml")
    assert "missing version = 1" in missing
    (unknown,) = problems_of(config_path=FIXTURES / "version-2.toml")
    assert unknown.endswith("version = 2: unsupported, this gpuguard reads version = 1")


@pytest.mark.parametrize("version", ['"1"', "true", "1.0"])
def test_a_version_of_the_wrong_type_is_an_error(tmp_path: Path, version: str) -> None:
    (problem,) = problems_of(config_path=write(tmp_path, f"version = {version}\n"))
    assert "unsupported" in problem


def test_an_unreadable_file_is_an_error(tmp_path: Path) -> None:
    (problem,) = problems_of(config_path=tmp_path / "absent.toml")
    assert problem == (
        f"{tmp_path / 'absent.toml'}: cannot read config file: No such file or directory"
    )


def test_a_section_that_is_not_a_table_is_an_error(tmp_path: Path) -> None:
    (problem,) = problems_of(config_path=write(tmp_path, 'version = 1\nnode = "x"\n'))
    assert problem.endswith('node = "x": must be a table [node]')


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=[case.id for case in BAD_CONFIGS])
def test_rejects_a_bad_value_naming_file_key_value_and_what_is_allowed(
    tmp_path: Path, case: BadConfig
) -> None:
    """Every value the loader refuses, in one list with the chart's test (tests/config_cases.py):
    helm must refuse each too."""
    path = write(tmp_path, case.toml())
    (problem,) = problems_of(config_path=path)
    assert problem.startswith(f"{path}: {case.names}"), problem
    assert case.reason in problem, problem


def test_accepts_integer_bytes_and_zero_reserve_in_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path, "version = 1\n[limits]\ndefault = 8589934592\nreplicas_reserve_bytes = 0\n"
    )
    limits = load_settings(config_path=path, environ={}).limits
    assert limits.default == LimitValue(limit_bytes=8 * GI)
    assert limits.replicas_reserve_bytes == 0
    env = {"GPUGUARD_LIMITS_REPLICAS_RESERVE_BYTES": "0Mi"}
    assert load_settings(environ=env).limits.replicas_reserve_bytes == 0


def test_reports_env_and_flag_problems_with_their_source_alongside_file_problems(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "version = 1\n[enforcement]\ngrace_seconds = -1\n")
    problems = problems_of(
        config_path=path,
        environ={"GPUGUARD_ENFORCEMENT_MODE": "loud", "GPUGUARD_ENFORCMENT_MODE": "enforce"},
        overrides={"kube.watch_timeout_seconds": "soon", "kube.nope": 1},
    )
    assert problems == [
        f"{path}: enforcement.grace_seconds = -1: must be a number ≥ 0 (seconds)",
        'env GPUGUARD_ENFORCEMENT_MODE: enforcement.mode = "loud": must be one of "enforce", '
        '"audit"',
        "env GPUGUARD_ENFORCMENT_MODE: unknown setting: did you mean GPUGUARD_ENFORCEMENT_MODE? "
        "(GPUGUARD_<SECTION>_<KEY>, e.g. GPUGUARD_ENFORCEMENT_MODE; per-namespace limits are "
        "file-only)",
        'command line: kube.watch_timeout_seconds = "soon": must be a number > 0 (seconds)',
        "command line: unknown setting kube.nope (section.key, e.g. enforcement.mode)",
    ]


@pytest.mark.parametrize(
    ("toml", "environ", "overrides", "suggestion"),
    [
        ('[enforcment]\nmode = "audit"\n', {}, {}, "key enforcment: did you mean [enforcement]?"),
        ("[enforcement]\ngrace_second = 3\n", {}, {}, "did you mean enforcement.grace_seconds?"),
        ('[nvml]\nlibrary-path = ""\n', {}, {}, "did you mean nvml.library_path?"),
        ('[limits.namespaces.ml]\ndefualt = "8Gi"\n', {}, {}, "mean limits.namespaces.ml.default?"),
        (
            "",
            {"GPUGUARD_LIMITS_EXEMPT_NAMESPACE": "a"},
            {},
            "mean GPUGUARD_LIMITS_EXEMPT_NAMESPACES?",
        ),
        ("", {}, {"enforcement.mod": "audit"}, "enforcement.mod: did you mean enforcement.mode?"),
    ],
)
def test_a_misspelt_key_is_answered_with_the_nearest_allowed_one(
    tmp_path: Path,
    toml: str,
    environ: dict[str, str],
    overrides: dict[str, object],
    suggestion: str,
) -> None:
    path = write(tmp_path, "version = 1\n" + toml)
    problems = problems_of(config_path=path, environ=environ, overrides=overrides)
    assert len(problems) == 1
    assert suggestion in problems[0]


@pytest.mark.parametrize(
    ("toml", "environ"),
    [
        ("[telemetry]\nx = 1\n", {}),
        ("[enforcement]\nxyz = 1\n", {}),
        ("[enforcement]\n" + "m" * 200 + " = 1\n", {}),
        ("", {"GPUGUARD_FOO": "1"}),
    ],
)
def test_a_key_close_to_nothing_allowed_gets_no_guess(
    tmp_path: Path, toml: str, environ: dict[str, str]
) -> None:
    path = write(tmp_path, "version = 1\n" + toml)
    problems = problems_of(config_path=path, environ=environ)
    assert len(problems) == 1
    assert "did you mean" not in problems[0]


def test_a_later_valid_source_does_not_hide_an_earlier_invalid_one(tmp_path: Path) -> None:
    path = write(tmp_path, 'version = 1\n[enforcement]\nmode = "kill"\n')
    problems = problems_of(config_path=path, environ={"GPUGUARD_ENFORCEMENT_MODE": "enforce"})
    assert len(problems) == 1
    assert "kill" in problems[0]


def test_namespace_tables_are_not_settable_from_env_or_flags() -> None:
    problems = problems_of(
        environ={"GPUGUARD_LIMITS_NAMESPACES": "x"}, overrides={"limits.namespaces": {}}
    )
    assert len(problems) == 2


# --- invariants -------------------------------------------------------------------------------


def test_staleness_must_exceed_two_poll_intervals(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "version = 1\n[enforcement]\npoll_interval_seconds = 12\nstaleness_seconds = 24\n",
    )
    (problem,) = problems_of(config_path=path)
    assert problem == (
        f"{path}: enforcement.staleness_seconds = 24: must be more than twice "
        f"enforcement.poll_interval_seconds (24, from {path}), else every sample would be stale"
    )


def test_staleness_must_exceed_the_nvml_and_watch_timeouts() -> None:
    problems = problems_of(
        environ={
            "GPUGUARD_ENFORCEMENT_STALENESS_SECONDS": "4",
            "GPUGUARD_KUBE_WATCH_TIMEOUT_SECONDS": "4",
        }
    )
    assert len(problems) == 2
    assert "nvml.call_timeout_seconds (5, from default)" in problems[0]
    assert (
        "kube.watch_timeout_seconds (4, from env GPUGUARD_KUBE_WATCH_TIMEOUT_SECONDS)"
        in (problems[1])
    )


def test_an_invalid_value_is_reported_once_not_again_as_a_broken_invariant() -> None:
    problems = problems_of(environ={"GPUGUARD_ENFORCEMENT_STALENESS_SECONDS": "-3"})
    assert len(problems) == 1


def test_a_namespace_default_within_its_max_is_fine_and_percent_and_bytes_are_not_compared(
    tmp_path: Path,
) -> None:
    path = write(
        tmp_path,
        'version = 1\n[limits.namespaces.a]\ndefault = "8Gi"\nmax = "8Gi"\n'
        '[limits.namespaces.b]\ndefault = "50%"\nmax = "8Gi"\n',
    )
    namespaces = load_settings(config_path=path, environ={}).limits.namespaces
    assert set(namespaces) == {"a", "b"}


@pytest.mark.parametrize("value", [",", " , ", "kube-system,", ",kube-system", "a,,b", ""])
def test_an_empty_entry_in_the_exempt_namespaces_variable_is_an_error_not_no_exemptions(
    value: str,
) -> None:
    """``GPUGUARD_LIMITS_EXEMPT_NAMESPACES=,`` once silently emptied the exempt list."""
    env = {"GPUGUARD_LIMITS_EXEMPT_NAMESPACES": value}
    if value == "":  # an empty variable is unset (test_empty_env_values_count_as_unset)
        assert "kube-system" in load_settings(environ=env).limits.exempt_namespaces
        return
    (problem,) = problems_of(environ=env)
    assert "GPUGUARD_LIMITS_EXEMPT_NAMESPACES" in problem
    assert "empty entry" in problem
    assert "exempt_namespaces = []" in problem


def test_the_exempt_namespace_label_becomes_the_policys_key_and_value(tmp_path: Path) -> None:
    path = write(
        tmp_path, 'version = 1\n[limits]\nexempt_namespace_label = "gpuguard.io/exempt=true"\n'
    )
    settings = load_settings(config_path=path, environ={})
    assert settings.limit_policy().exempt_label == ("gpuguard.io/exempt", "true")
    env = {env_var("limits", "exempt_namespace_label"): "example.com/gpu-system="}
    assert load_settings(environ=env).limit_policy().exempt_label == ("example.com/gpu-system", "")
    assert load_settings(environ={}).limit_policy().exempt_label is None


def test_exempting_no_namespace_is_an_explicit_choice_in_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "version = 1\n[limits]\nexempt_namespaces = []\n")
    assert load_settings(config_path=path, environ={}).limits.exempt_namespaces == frozenset()


def test_with_a_pods_file_staleness_is_not_bound_by_the_api_servers_watch_timeout() -> None:
    """A pods file has no watch: ``kube.watch_timeout_seconds`` bounds nothing there, and
    ``enforce --pods-file`` refused a staleness below it."""
    env = {
        "GPUGUARD_ENFORCEMENT_STALENESS_SECONDS": "6",
        "GPUGUARD_KUBE_WATCH_TIMEOUT_SECONDS": "30",
    }
    assert load_settings(environ=env, uses_api_server=False).enforcement.staleness_seconds == 6
    (problem,) = problems_of(environ=env)
    assert "kube.watch_timeout_seconds" in problem


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory", "too-large", "binary"])
def test_a_config_path_that_is_not_a_small_text_file_is_one_clear_problem(
    tmp_path: Path, kind: str
) -> None:
    """``--config /dev/zero`` exhausted memory and a FIFO hung the command."""
    import os

    path = tmp_path / "config.toml"
    if kind == "dev-zero":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "too-large":
        path.write_text("version = 1\n" + "# padding\n" * 200_000)
    else:
        path.write_bytes(b"version = 1\n\x00\x01")
    (problem,) = problems_of(config_path=path)
    assert problem.startswith(f"{path}: ")
    assert len(problem) < 300


# --- [agent]: the sharing agent -----------------------------------------------------------------


def test_the_agent_defaults_read_gpuguard_sharing_never_evict_and_listen_beside_the_enforcer() -> (
    None
):
    agent = load_settings(environ={}).agent
    assert agent == AgentSettings(
        sharing_namespace="gpuguard",
        sharing_name="gpuguard-sharing",
        allow_eviction=False,
        keep_cordon_on_failure=False,
        metrics_address="0.0.0.0:9411",
        interval_seconds=1.0,
        min_write_interval_seconds=1.0,
    )
    assert agent.metrics_address != Settings().metrics.address  # one pod, one network namespace


def test_the_agent_section_loads_from_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "version = 1\n[agent]\n"
        'sharing_namespace = "kube-gpu"\nsharing_name = "sharing.v2"\n'
        "allow_eviction = true\nkeep_cordon_on_failure = true\n"
        'metrics_address = "[::]:9511"\ninterval_seconds = 0.5\n'
        "min_write_interval_seconds = 0\n",
    )
    assert load_settings(config_path=path, environ={}).agent == AgentSettings(
        sharing_namespace="kube-gpu",
        sharing_name="sharing.v2",
        allow_eviction=True,
        keep_cordon_on_failure=True,
        metrics_address="[::]:9511",
        interval_seconds=0.5,
        min_write_interval_seconds=0.0,
    )


def test_agent_env_variables_override_the_file_and_flags_override_them(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'version = 1\n[agent]\nallow_eviction = true\nsharing_name = "from-file"\n'
        "interval_seconds = 5\n",
    )
    environ = {
        "GPUGUARD_AGENT_SHARING_NAMESPACE": "gpu-sharing",
        "GPUGUARD_AGENT_SHARING_NAME": "from-env",
        "GPUGUARD_AGENT_ALLOW_EVICTION": "false",
        "GPUGUARD_AGENT_KEEP_CORDON_ON_FAILURE": "true",
        "GPUGUARD_AGENT_METRICS_ADDRESS": ":9412",
        "GPUGUARD_AGENT_INTERVAL_SECONDS": "2.5",
        "GPUGUARD_AGENT_MIN_WRITE_INTERVAL_SECONDS": "10",
    }
    assert [env_var("agent", f.name) for f in dataclasses.fields(AgentSettings)] == list(environ)
    agent = load_settings(
        config_path=path, environ=environ, overrides={"agent.interval_seconds": "0.25"}
    ).agent
    assert agent == AgentSettings(
        sharing_namespace="gpu-sharing",
        sharing_name="from-env",
        allow_eviction=False,  # env over file
        keep_cordon_on_failure=True,
        metrics_address=":9412",
        interval_seconds=0.25,  # flag over env over file
        min_write_interval_seconds=10.0,
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("interval_seconds", "0.05"), ("interval_seconds", "60"), ("min_write_interval_seconds", "0"),
     ("min_write_interval_seconds", "60")],
)  # fmt: skip
def test_the_agent_intervals_include_their_bounds(key: str, value: str) -> None:
    agent = load_settings(environ={env_var("agent", key): value}).agent
    assert getattr(agent, key) == float(value)


def test_reports_every_bad_agent_value_at_once_from_each_source(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'version = 1\n[agent]\nsharing_namespace = "Bad_NS"\ninterval_seconds = 0.01\n'
        "allow_evictions = true\n",
    )
    problems = problems_of(
        config_path=path,
        environ={
            "GPUGUARD_AGENT_ALLOW_EVICTION": "maybe",
            "GPUGUARD_AGENT_MIN_WRITE_INTERVAL_SECONDS": "120",
        },
        overrides={"agent.metrics_address": "localhost"},
    )
    assert problems == [
        f'{path}: agent.sharing_namespace = "Bad_NS": must be a namespace name (lower-case DNS '
        'label, ≤ 63 characters, e.g. "gpuguard")',
        f"{path}: agent.interval_seconds = 0.01: must be a number from 0.05 to 60 (seconds)",
        f"{path}: unknown key agent.allow_evictions: did you mean agent.allow_eviction? "
        "(allowed in [agent]: sharing_namespace, "
        "sharing_name, allow_eviction, keep_cordon_on_failure, metrics_address, "
        "interval_seconds, min_write_interval_seconds)",
        'env GPUGUARD_AGENT_ALLOW_EVICTION: agent.allow_eviction = "maybe": must be true or false',
        'env GPUGUARD_AGENT_MIN_WRITE_INTERVAL_SECONDS: agent.min_write_interval_seconds = "120": '
        "must be a number from 0 to 60 (seconds)",
        'command line: agent.metrics_address = "localhost": no ":port"; must be "host:port" '
        'with a port from 0 to 65535 (e.g. "0.0.0.0:9410", ":9410" for all interfaces, '
        '"[::1]:9410")',
    ]


def test_an_unknown_agent_key_is_rejected_from_the_environment_and_the_command_line() -> None:
    problems = problems_of(
        environ={"GPUGUARD_AGENT_ALLOW_EVICTIONS": "true"},
        overrides={"agent.evict": True},
    )
    assert problems == [
        "env GPUGUARD_AGENT_ALLOW_EVICTIONS: unknown setting: did you mean "
        "GPUGUARD_AGENT_ALLOW_EVICTION? (GPUGUARD_<SECTION>_<KEY>, e.g. GPUGUARD_ENFORCEMENT_MODE; "
        "per-namespace limits are file-only)",
        "command line: unknown setting agent.evict: did you mean agent.allow_eviction? "
        "(section.key, e.g. enforcement.mode)",
    ]


def test_the_agent_settings_render_in_the_startup_log() -> None:
    environ = {"GPUGUARD_AGENT_ALLOW_EVICTION": "true", "GPUGUARD_AGENT_INTERVAL_SECONDS": "2"}
    rendered = load_settings(environ=environ).to_dict()
    assert rendered["agent"] == {
        "sharing_namespace": "gpuguard",
        "sharing_name": "gpuguard-sharing",
        "allow_eviction": True,
        "keep_cordon_on_failure": False,
        "metrics_address": "0.0.0.0:9411",
        "interval_seconds": 2.0,
        "min_write_interval_seconds": 1.0,
    }


def test_fast_path_off_and_pressure_off_are_valid(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "version = 1\n[enforcement]\nfast_interval_seconds = 0\npressure_free_fraction = 0\n"
        'fast_step_bytes = "0"\n'
    )
    enforcement = load_settings(config_path=path, environ={}).enforcement
    assert (enforcement.fast_interval_seconds, enforcement.pressure_free_fraction) == (0.0, 0.0)
    assert enforcement.fast_step_bytes == 0


# --- limits.sources (the order is no precedence) --------------------------------------------------


@pytest.mark.parametrize(
    "sources",
    [
        ["gpuguard"],
        ["gpuguard", "kai", "hami", "gpushare", "volcano"],
        ["kai", "gpuguard"],  # once an error ("gpuguard must come first")
        ["volcano", "hami"],
    ],
)
def test_limits_sources_are_known_names_in_any_order(tmp_path: Path, sources: list[str]) -> None:
    path = write(tmp_path, f"version = 1\n[limits]\nsources = {sources!r}\n".replace("'", '"'))
    settings = load_settings(config_path=path, environ={})
    assert settings.limits.sources == tuple(sources)
    assert settings.enforcement_policy().limits.sources == tuple(sources)


# --- checker_rules: the loader's rules as data, for the Helm chart --------------------------------


def test_every_rule_says_what_the_loader_says_of_a_value_of_the_wrong_type(
    tmp_path: Path,
) -> None:
    for section, rules in checker_rules()["fields"].items():
        for key, rule in rules.items():
            if rule["kind"] == "tables":
                continue
            path = write(tmp_path, f"version = 1\n[{section}]\n{key} = {{ x = 1 }}\n")
            (problem,) = problems_of(config_path=path)
            assert problem == f"{path}: {section}.{key} = {{…}}: " + rule["allowed"] + (
                rule.get("empty", "") if rule["kind"] == "sources" else ""
            )


def test_the_rules_carry_each_settings_default() -> None:
    rendered = Settings().to_dict()
    for section, rules in checker_rules()["fields"].items():
        for key, rule in rules.items():
            if rule["kind"] != "tables":
                assert rule["default"] == rendered[section][key], (section, key)


def test_the_smallest_percentage_is_exactly_where_the_loader_stops_refusing() -> None:
    smallest = checker_rules()["percent_below_minimum"]["smallest_percent"]
    assert not percent_below_minimum(smallest)
    assert percent_below_minimum(math.nextafter(smallest, 0))


MPS_GPU = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"


def test_mps_is_declared_per_gpu_by_the_admin_and_by_no_one_by_default(tmp_path: Path) -> None:
    assert load_settings(environ={}).enforcement_policy().mps_gpus == frozenset()
    path = write(tmp_path, f'version = 1\n[enforcement]\nmps_gpus = ["{MPS_GPU}"]\n')
    policy = load_settings(config_path=path, environ={}).enforcement_policy()
    assert policy.mps_declared(GpuUuid(MPS_GPU))
    assert not policy.mps_declared(GpuUuid("GPU-00000000-0000-0000-0000-000000000000"))
    env = {"GPUGUARD_ENFORCEMENT_MPS_GPUS": "all"}
    assert load_settings(environ=env).enforcement_policy().mps_declared(GpuUuid(MPS_GPU))


@pytest.mark.parametrize(
    "value", ['"all"', '["GPU-1"]', '["gpu-0"]', "[0]", f'["{MPS_GPU}", ""]', '["MIG-x"]']
)
def test_an_mps_gpu_that_is_not_a_gpu_uuid_is_an_error_naming_the_form(
    tmp_path: Path, value: str
) -> None:
    path = write(tmp_path, f"version = 1\n[enforcement]\nmps_gpus = {value}\n")
    (problem,) = problems_of(config_path=path, environ={})
    assert "enforcement.mps_gpus" in problem
    assert "GPU UUIDs" in problem


def test_a_pods_file_run_reads_no_kubelet_unless_one_is_named(tmp_path: Path) -> None:
    """``--pods-file`` stands in for a cluster: the kubelet's pod-resources socket is off by
    default (no warning about a socket that cannot exist there), read where it is named."""
    default = load_settings(environ={}, uses_api_server=True)
    assert default.node.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert load_settings(environ={}, uses_api_server=False).node.pod_resources_socket is None
    named = tmp_path / "kubelet.sock"
    env = {"GPUGUARD_NODE_POD_RESOURCES_SOCKET": str(named)}
    assert load_settings(environ=env, uses_api_server=False).node.pod_resources_socket == named
