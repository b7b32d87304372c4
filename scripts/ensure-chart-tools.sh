#!/usr/bin/env bash
# Prepares (once) the chart checkers of tests/test_chart_tools.py, in a cache outside the repo,
# and prints the cache directory (the last line of stdout; everything else goes to stderr):
#
#   bin/kubeconform     github.com/yannh/kubeconform v0.8.0          (testbin/chart-tools/kubeconform)
#   bin/helm-unittest   github.com/helm-unittest/helm-unittest v1.1.2 (testbin/chart-tools/helm-unittest)
#   bin/ct              github.com/helm/chart-testing/v3 v3.13.0      (testbin/chart-tools/ct)
#   ct/etc/             ct's chart_schema.yaml and lintconf.yaml, from that same module
#   venv/               python with yamllint==1.38.0 and yamale==6.1.0, which ct runs
#   schemas/kubernetes/v1.37.0-standalone-strict/
#                       Kubernetes v1.37 JSON schemas from PyPI kubernetes-validate==1.37.0,
#                       their absolute $id and /api/_definitions.json references made relative
#   schemas/crds/monitoring.coreos.com/{kind}_{version}.json
#                       the prometheus-operator v0.85.0 CRDs' openAPIV3Schema (ServiceMonitor,
#                       PrometheusRule, ...), from example/prometheus-operator-crd/ in its module
#
# The Go tools build from wrapper modules (go.mod + go.sum committed, checksums verified): helm-
# unittest's own go.mod has a replace, so `go install …@v1.1.2` refuses it; ct is the same for
# symmetry. The cache key is go version + python version + the wrapper modules + the pinned
# versions; each part is complete or absent (built into a scratch name, moved last), so an
# interrupted run resumes where it stopped. Idempotent: a warm cache costs a hash.
# Cold (empty Go module, Go build and pip caches; 2 cores shared with another Go build, load ~8),
# measured 2026-12-03: 418 s wall, 248 s CPU: kubeconform 120 s, ct 79 s, helm-unittest 202 s
# (helm's v3 library and client-go), venv 11 s, schemas 5 s. Warm: ~1 s. ~95 MB cached here,
# plus ~430 MB of Go modules and ~450 MB of Go build cache.
#
#   CHART_TOOLS_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-chart-tools)
#   PYTHON=python3           the interpreter the private venv is made from
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODS="$ROOT/testbin/chart-tools"
KUBECONFORM_VERSION=v0.8.0
HELM_UNITTEST_VERSION=v1.1.2
CT_VERSION=v3.13.0
CT_MODULE=github.com/helm/chart-testing/v3
YAMLLINT_VERSION=1.38.0
YAMALE_VERSION=6.1.0
K8S_VALIDATE_VERSION=1.37.0
# The wheel's sha256 (PyPI), checked before its schemas are trusted.
K8S_VALIDATE_SHA256=85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9
K8S_SCHEMA_VERSION=v1.37.0
PROM_OPERATOR_MODULE=github.com/prometheus-operator/prometheus-operator
PROM_OPERATOR_VERSION=v0.85.0
PYTHON="${PYTHON:-python3}"
export PATH="$PATH:/usr/local/go/bin"
export GOWORK=off CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
START=$SECONDS

say() { printf '[ensure-chart-tools %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "$*"; exit 1; }

command -v go >/dev/null || die "go not found (need go1.26.x on PATH or /usr/local/go/bin)"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON)"
KEY=$({
  go version
  "$PYTHON" --version
  echo "$KUBECONFORM_VERSION $HELM_UNITTEST_VERSION $CT_VERSION $YAMLLINT_VERSION $YAMALE_VERSION"
  echo "$K8S_VALIDATE_VERSION $K8S_VALIDATE_SHA256 $K8S_SCHEMA_VERSION $PROM_OPERATOR_VERSION"
  cat "$MODS"/*/go.mod "$MODS"/*/go.sum
  grep -v '^[[:space:]]*#' "$0" # the schema conversions below (comments aside)
} | sha256sum | cut -c1-16)
BASE="${CHART_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-chart-tools}"
DEST="$BASE/$KEY"
mkdir -p "$DEST/bin"
TMP=$(mktemp -d "$BASE/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# build NAME LDFLAGS: the wrapper module's one tool, into bin/NAME.
build() {
  local name=$1 ldflags=$2 t0=$SECONDS
  if [[ -x $DEST/bin/$name ]]; then
    say "$name: cached"
    return
  fi
  say "$name: building from testbin/chart-tools/$name…"
  (cd "$MODS/$name" && nice -n 10 go build -trimpath -ldflags "-s -w $ldflags" -o "$TMP/$name" tool)
  mv -f "$TMP/$name" "$DEST/bin/$name"
  say "$name: built in $((SECONDS - t0))s"
}

build kubeconform "-X main.version=$KUBECONFORM_VERSION"
build ct "-X $CT_MODULE/ct/cmd.Version=$CT_VERSION"
build helm-unittest ""

# ct's Chart.yaml schema and yamllint config, from the module ct was built from.
if [[ -f $DEST/ct/etc/lintconf.yaml ]]; then
  say "ct/etc: cached"
else
  dir=$(cd "$MODS/ct" && go list -m -f '{{.Dir}}' "$CT_MODULE")
  [[ -f $dir/etc/chart_schema.yaml ]] || die "no etc/chart_schema.yaml in $dir"
  mkdir -p "$TMP/etc"
  cp "$dir/etc/chart_schema.yaml" "$dir/etc/lintconf.yaml" "$TMP/etc/"
  chmod 644 "$TMP"/etc/*
  rm -rf "$DEST/ct" && mkdir -p "$DEST/ct" && mv "$TMP/etc" "$DEST/ct/etc"
  say "ct/etc: copied from $dir"
fi

# The private venv ct runs yamllint and yamale from (its PATH), apart from the project's.
VENV="$DEST/venv"
if [[ -x $VENV/bin/yamllint && -x $VENV/bin/yamale && -f $VENV/.complete ]]; then
  say "venv: cached"
else
  t0=$SECONDS
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "yamllint==$YAMLLINT_VERSION" "yamale==$YAMALE_VERSION"
  touch "$VENV/.complete"
  say "venv: yamllint $YAMLLINT_VERSION, yamale $YAMALE_VERSION in $((SECONDS - t0))s"
fi

# Kubernetes schemas: kubernetes-validate's "-local-strict" set (additionalProperties: false
# throughout). Each file has "$id": "https://kubernetes.io/api/<kind>/<group>/<version>" and
# refs to "/api/_definitions.json#/$defs/…", which kubeconform would resolve against
# kubernetes.io: drop the $id so refs resolve against the file itself, and make them relative.
K8S_DIR="$DEST/schemas/kubernetes/$K8S_SCHEMA_VERSION-standalone-strict"
if [[ -f $K8S_DIR/_definitions.json && -f $K8S_DIR/.complete ]]; then
  say "kubernetes schemas: cached"
else
  t0=$SECONDS
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
    -d "$TMP/wheel" "kubernetes-validate==$K8S_VALIDATE_VERSION"
  wheel=$(echo "$TMP"/wheel/kubernetes_validate-*.whl)
  got=$(sha256sum "$wheel" | cut -d' ' -f1)
  [[ $got == "$K8S_VALIDATE_SHA256" ]] || die "kubernetes-validate wheel sha256 $got, expected $K8S_VALIDATE_SHA256"
  "$VENV/bin/python" - "$wheel" "$K8S_SCHEMA_VERSION-local-strict" "$TMP/k8s" <<'EOF'
import json, sys, zipfile
from pathlib import Path

wheel, version, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
prefix = f"kubernetes_validate/kubernetes-json-schema/{version}/"
out.mkdir(parents=True)


def relative(node: object) -> object:
    # Not every "$ref" key is a reference: JSONSchemaProps has a property named "$ref".
    if isinstance(node, dict):
        return {
            k: (
                v.replace("/api/_definitions.json", "_definitions.json")
                if k == "$ref" and isinstance(v, str)
                else relative(v)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [relative(v) for v in node]
    return node


count = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".json"):
            schema = json.loads(z.read(name))
            schema.pop("$id", None)
            schema = relative(schema)
            (out / name[len(prefix):]).write_text(json.dumps(schema))
            count += 1
if count < 500 or not (out / "daemonset-apps-v1.json").exists():
    sys.exit(f"only {count} schemas under {prefix}")
print(f"{count} schemas", file=sys.stderr)
EOF
  rm -rf "$K8S_DIR" && mkdir -p "$(dirname "$K8S_DIR")" && mv "$TMP/k8s" "$K8S_DIR"
  touch "$K8S_DIR/.complete"
  say "kubernetes schemas: $K8S_SCHEMA_VERSION from kubernetes-validate $K8S_VALIDATE_VERSION in $((SECONDS - t0))s"
fi

# CRD schemas: each served version's openAPIV3Schema, closed (no unknown fields), as
# {group}/{kind}_{version}.json (kind in lower case, kubeconform's {{.ResourceKind}}), from the
# prometheus-operator module's CRDs.
CRD_DIR="$DEST/schemas/crds"
if [[ -f $CRD_DIR/.complete ]]; then
  say "CRD schemas: cached"
else
  t0=$SECONDS
  dir=$(cd "$TMP" && go mod download -json "$PROM_OPERATOR_MODULE@$PROM_OPERATOR_VERSION" |
    "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  "$VENV/bin/python" - "$dir/example/prometheus-operator-crd" "$TMP/crds" <<'EOF'
import json, sys
from pathlib import Path

import yaml



class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML 1.1 reads a bare `=` (an enum value in the CRDs) as the "value" tag: a string here."""


Loader.add_constructor("tag:yaml.org,2002:value", Loader.construct_yaml_str)



def closed(node: object) -> object:
    """additionalProperties: false wherever a schema lists properties and says nothing else, as
    kubernetes-validate's -strict set has it: kubeconform -strict only picks the "-strict" schema
    set, it does not close a schema, and a CRD's structural schema leaves objects open. Objects
    with x-kubernetes-preserve-unknown-fields stay open (the API server keeps unknown fields)."""
    if isinstance(node, list):
        return [closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: (v if k == "properties" else closed(v)) for k, v in node.items()}
    if isinstance(node.get("properties"), dict):
        node["properties"] = {k: closed(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    return node


src, out = Path(sys.argv[1]), Path(sys.argv[2])
written = []
for path in sorted(src.glob("*.yaml")):
    for crd in yaml.load_all(path.read_text(), Loader=Loader):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        spec = crd["spec"]
        for version in spec["versions"]:
            schema = closed(version["schema"]["openAPIV3Schema"])
            target = out / spec["group"] / f"{spec['names']['kind'].lower()}_{version['name']}.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(schema))
            written.append(f"{spec['group']}/{target.name}")
for needed in ("servicemonitor_v1.json", "prometheusrule_v1.json"):
    if f"monitoring.coreos.com/{needed}" not in written:
        sys.exit(f"no {needed} from {src}")
print(" ".join(written), file=sys.stderr)
EOF
  rm -rf "$CRD_DIR" && mv "$TMP/crds" "$CRD_DIR"
  touch "$CRD_DIR/.complete"
  say "CRD schemas: prometheus-operator $PROM_OPERATOR_VERSION in $((SECONDS - t0))s"
fi

v=$("$DEST/bin/kubeconform" -v)
[[ $v == "$KUBECONFORM_VERSION" ]] || die "unexpected kubeconform version: $v"
v=$("$DEST/bin/ct" version 2>&1)
[[ $v == *"$CT_VERSION"* ]] || die "unexpected ct version: $v"
"$DEST/bin/helm-unittest" --help >/dev/null || die "helm-unittest does not run"
ln -sfn "$DEST" "$BASE/current"
say "ready: $DEST (total $((SECONDS - START))s)"
echo "$DEST"
