"""Configuration: one frozen ``Settings`` tree from defaults < TOML file < env < command line.

Owns every tunable's name, type, unit, default and validation, and the translation into the core's
``EnforcementPolicy``. Must not act on the settings (no NVML, no API server, no logging setup):
``app.py`` wires them. Nothing below ``app.py`` reads the environment or files for configuration;
``load_settings`` receives the environment as a mapping so tests pass their own.

Sources, lowest precedence first (docs/design.md, Configuration):

1. the defaults (``settings``: each field's docstring gives unit, default and why);
2. a TOML file (``file``; ``config.example.toml`` documents every key): ``version = 1`` is
   required, unknown versions, sections and keys are errors. Its path: ``config_path``, else
   ``$GPUGUARD_CONFIG``;
3. environment variables ``GPUGUARD_<SECTION>_<KEY>`` (``overlay``: ``GPUGUARD_NODE_NAME``,
   ``GPUGUARD_ENFORCEMENT_MODE``, ``GPUGUARD_LIMITS_EXEMPT_NAMESPACES=a,b``: lists are
   comma-separated, booleans ``true``/``false``). An empty variable counts as unset (Helm
   templates render absent values as ""). ``NODE_NAME`` (the downward API's
   ``spec.nodeName``) is the fallback for ``node.name``. Per-namespace tables are file-only.
   Unknown ``GPUGUARD_*`` variables are errors, except the service links the kubelet injects for
   a Service named ``gpuguard…`` (``GPUGUARD_SERVICE_HOST``, ``GPUGUARD_PORT_9410_TCP``…);
4. command-line overrides (``overlay``): a mapping of dotted keys
   (``{"enforcement.mode": "enforce"}``) the CLI builds from its flags; strings are parsed like
   environment values.

Every problem found is reported at once in one ``ConfigError``, each naming its source (file,
variable or command line), the key, the bad value and what is allowed; an unknown name also
names the allowed one it most likely meant (``did you mean enforcement.grace_seconds?``).

The modules, one job each: ``settings`` (the tree and its defaults), ``parsers`` and
``limit_fields`` (one value each), ``address`` (listen addresses), ``messages`` (how problems
name values and keys), ``collected`` (values with their source, and problems), ``file`` and
``overlay`` (the sources), ``checks`` (rules across keys), ``loader`` (``load_settings``) and
``rules`` (``checker_rules``, the same rules as data for the Helm chart). This package re-exports
their public names.
"""

from __future__ import annotations

from gpuguard.config.address import (
    InvalidListenAddress,
    ListenAddress,
    parse_listen_address,
)
from gpuguard.config.file import CONFIG_VERSION, MAX_CONFIG_BYTES
from gpuguard.config.loader import load_settings
from gpuguard.config.overlay import CONFIG_PATH_ENV, ENV_PREFIX, NODE_NAME_ENV, env_var
from gpuguard.config.rules import checker_rules
from gpuguard.config.settings import (
    SECTIONS,
    AgentSettings,
    EnforcementSettings,
    KubeSettings,
    LimitsSettings,
    LogFormat,
    LoggingSettings,
    LogLevel,
    MetricsSettings,
    NamespaceSettings,
    NodeSettings,
    NvmlSettings,
    Settings,
    settable_keys,
)

__all__ = [
    "CONFIG_PATH_ENV",
    "CONFIG_VERSION",
    "ENV_PREFIX",
    "MAX_CONFIG_BYTES",
    "NODE_NAME_ENV",
    "SECTIONS",
    "AgentSettings",
    "EnforcementSettings",
    "InvalidListenAddress",
    "KubeSettings",
    "LimitsSettings",
    "ListenAddress",
    "LogFormat",
    "LogLevel",
    "LoggingSettings",
    "MetricsSettings",
    "NamespaceSettings",
    "NodeSettings",
    "NvmlSettings",
    "Settings",
    "checker_rules",
    "env_var",
    "load_settings",
    "parse_listen_address",
    "settable_keys",
]
