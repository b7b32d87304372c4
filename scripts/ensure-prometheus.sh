#!/usr/bin/env bash
# Builds (once) Prometheus 3.16.0 and promtool from the Go module, into a cache outside the repo
# keyed by go version + Prometheus version + build flags, and prints the directory that holds
# them (the last line of stdout; everything else goes to stderr). The alert-rule tests
# (tests/test_alerts.py) run this promtool; the end-to-end chain runs this prometheus.
# Idempotent: a warm cache costs a hash and two --version calls.
#
#   PROMETHEUS_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-prometheus)
#
# Why 3.16 from source and not Debian's 2.42: Prometheus 3 counts range-window samples
# differently (a range is left-open), so a rule that passes on 2.x can yield nothing on 3.x.
# The web UI is not embedded (its assets are not in the Go module); the HTTP API works.
set -euo pipefail
VERSION=3.16.0
MODULE=github.com/prometheus/prometheus
MODULE_VERSION=v0.316.0 # Prometheus 3.x is tagged v0.3xx.y for Go modules
TAGS=remove_all_sd      # no cloud service discovery: static configs and files are enough here
LDF="-s -w -X github.com/prometheus/common/version.Version=$VERSION"
LDF+=" -X github.com/prometheus/common/version.Revision=$MODULE_VERSION"
LDF+=" -X github.com/prometheus/common/version.Branch=module"
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"
go_env
need_go
BASE=$(cache_root PROMETHEUS_CACHE prometheus)
KEY=$({ go version; echo "$MODULE@$MODULE_VERSION $TAGS $LDF"; } | sha256sum | cut -c1-16)
DEST="$BASE/$VERSION-$KEY"
mkdir -p "$DEST"

if [[ -x $DEST/prometheus && -x $DEST/promtool ]]; then
  say "cached ($DEST)"
else
  avail=$(df -Pk "$BASE" | awk 'NR==2{print int($4/1024/1024)}')
  if ((avail < 4)); then say "warning: only ${avail} GiB free under $BASE (a cold build needs ~3 GiB)"; fi
  say "building prometheus and promtool $VERSION ($MODULE@$MODULE_VERSION; cold build, ~3-5 min on 2 cores)…"
  # `go install pkg@version` builds with the module's own go.mod and go.sum (verified against
  # the checksum database), so no wrapper module is needed: Prometheus's go.mod has no replace.
  # Into a scratch GOBIN first, so an interrupted build never leaves a half-filled cache entry.
  scratch_dir "$BASE" build
  (cd "$SCRATCH" && GOBIN="$SCRATCH" nice -n 10 go install -trimpath -tags "$TAGS" -ldflags "$LDF" \
    "$MODULE/cmd/prometheus@$MODULE_VERSION" "$MODULE/cmd/promtool@$MODULE_VERSION")
  mv -f "$SCRATCH/promtool" "$DEST/promtool"
  mv -f "$SCRATCH/prometheus" "$DEST/prometheus" # last: its presence marks the entry complete
  say "built in $((SECONDS - START))s"
fi
expect_version "$DEST/promtool" "version $VERSION "
say "$("$DEST/prometheus" --version 2>&1 | head -1)"
hand_over "$DEST" "$BASE"
