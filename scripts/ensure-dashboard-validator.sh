#!/usr/bin/env bash
# Builds (once) the Go checker of dashboards/validate (grafana-foundation-sdk's Go types: strict
# unmarshal + Validate; Prometheus's PromQL parser) into a cache outside the repo keyed by go
# version + module files, and prints the binary's path as the last line of stdout (everything
# else goes to stderr). Idempotent: a warm cache costs a hash.
# Cold (empty Go build cache): ~4 min on 2 cores, half of it Prometheus's parser and its
# dependencies (the same packages promtool's build compiles); ~5 s with a warm Go build cache.
#
#   DASHBOARD_VALIDATOR_CACHE=/dir   cache root
#                                    (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-dashboard-validator)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC="$ROOT/dashboards/validate"
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"
go_env
need_go
KEY=$({ go version; cat "$SRC/go.mod" "$SRC/go.sum" "$SRC/main.go"; } | sha256sum | cut -c1-16)
DEST="$(cache_root DASHBOARD_VALIDATOR_CACHE dashboard-validator)/$KEY"
BIN="$DEST/validate"
if [[ -x $BIN ]]; then
  say "cached ($DEST)"
else
  mkdir -p "$DEST"
  say "building the dashboard validator (grafana-foundation-sdk/go + promql/parser; cold ~4 min)…"
  # Into a scratch name first, so an interrupted build never leaves a half-written binary.
  (cd "$SRC" && nice -n 10 go build -trimpath -ldflags "-s -w" -o "$DEST/.validate.tmp.$$" .)
  mv -f "$DEST/.validate.tmp.$$" "$BIN"
  say "built in $((SECONDS - START))s"
fi
echo "$BIN"
