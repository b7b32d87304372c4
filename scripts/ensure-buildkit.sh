#!/usr/bin/env bash
# Builds (once) BuildKit's daemon and client for `make image` (scripts/build-image.sh: the image
# built without Docker), into a cache outside the repo keyed by go version + the wrapper module
# testbin/buildkit (go.mod + go.sum committed, checksums verified) + this script's build commands:
#
#   buildkitd, buildctl      github.com/moby/buildkit v0.34.2 (testbin/buildkit/go.mod),
#                            CGO_ENABLED=0, -trimpath; buildkitd runs containers with the node's
#                            runc (scripts/ensure-node.sh), so nothing else is built here
#
# Each binary is built into a scratch name and moved into place last, under a lock (parallel runs
# wait for each other, an interrupted run resumes where it stopped). Idempotent: a warm cache costs
# a hash and the --version calls. The last line of stdout is `BUILDKIT_BIN=<dir>`; everything else
# goes to stderr.
#
# Measured 2026-12-05 on the 2-vCPU CI machine kind, shared with other jobs' Go builds (load 14-23):
#   cold (BuildKit's modules downloaded, GOCACHE warm only for what the node build shares):
#     412 s wall (buildkitd 398 s incl. downloads, buildctl 14 s), 136 s user CPU, peak RSS 0.9 GB;
#     buildkitd 57 MB + buildctl 24 MB cached
#   warm cache (nothing to build): ~2 s (a hash, two --version calls)
#
#   BUILDKIT_CACHE=/dir       cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-buildkit)
#   --init                    one-off, to bump the version (commit the result): recreate the
#                             wrapper module testbin/buildkit through the Go module proxy
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB="$ROOT/testbin/buildkit"
BUILDKIT=v0.34.2
export PATH="$PATH:/usr/local/go/bin"
export GOWORK=off CGO_ENABLED=0 GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
START=$SECONDS

say() { printf '[ensure-buildkit %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "$*"; exit 1; }

command -v go >/dev/null || die "go not found (need go1.26.x on PATH or /usr/local/go/bin)"

if [[ ${1:-} == --init ]]; then
  (cd "$ROOT/testbin" && rm -rf buildkit && mkdir buildkit && cd buildkit \
    && go mod init testbin/buildkit \
    && go get -tool "github.com/moby/buildkit/cmd/buildkitd@$BUILDKIT" \
                    "github.com/moby/buildkit/cmd/buildctl@$BUILDKIT" \
    && go mod tidy)
  say "init done: commit testbin/buildkit"
  exit 0
fi

KEY=$({
  go version
  echo "$BUILDKIT"
  cat "$TB/go.mod" "$TB/go.sum"
  grep -v '^[[:space:]]*#' "$0" # the build commands below (comments aside)
} | sha256sum | cut -c1-16)
BASE="${BUILDKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-buildkit}"
DEST="$BASE/$KEY"
mkdir -p "$DEST"
exec 9>"$BASE/.lock"
flock 9 # one builder at a time; a waiter then finds the binaries built
TMP=$(mktemp -d "$BASE/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

LDF="-s -w -X github.com/moby/buildkit/version.Version=$BUILDKIT"
LDF+=" -X github.com/moby/buildkit/version.Revision=$BUILDKIT"
for name in buildkitd buildctl; do
  t0=$SECONDS
  if [[ -x $DEST/$name ]]; then
    say "$name: cached"
    continue
  fi
  say "$name: building from testbin/buildkit…"
  (cd "$TB" && nice -n 10 go build -trimpath -ldflags "$LDF" -o "$TMP/$name" \
    "github.com/moby/buildkit/cmd/$name")
  mv -f "$TMP/$name" "$DEST/$name"
  say "$name: built in $((SECONDS - t0))s"
done
say "$("$DEST/buildkitd" --version 2>&1 | head -1)"
say "$("$DEST/buildctl" --version 2>&1 | head -1)"
say "ready (total ${SECONDS}s)"
echo "BUILDKIT_BIN=$DEST"
