#!/usr/bin/env bash
# Builds (once) crane, go-containerregistry's registry client, for `make push-image`
# (scripts/push-image.sh: the image pushed without Docker), into a cache outside the repo keyed by
# go version + the wrapper module testbin/crane (go.mod + go.sum committed, checksums verified) +
# this script's build commands:
#
#   crane    github.com/google/go-containerregistry/cmd/crane v0.22.1 (testbin/crane/go.mod),
#            CGO_ENABLED=0, -trimpath: one static binary, no daemon; `crane push` sends an OCI
#            layout's manifest and blobs as they are (the pushed digest is the archive's), and
#            `crane registry serve` is the in-process registry the push test pushes to
#
# Built into a scratch name and moved into place last, under a lock (parallel runs wait for each
# other). Idempotent: a warm cache costs a hash and a `crane version`. The last line of stdout is
# the directory holding `crane`; everything else goes to stderr.
#
# Measured 2026-12-07 on the 2-vCPU CI machine kind, beside a `make image` build: cold (modules
# downloaded, empty Go build cache) 39 s wall, 36 s user CPU, peak RSS 0.3 GB; crane 12 MB cached.
# Warm Go build cache: under 1 s; warm cache (nothing to build): a hash and `crane version`.
#
#   CRANE_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-crane)
#   --init             one-off, to bump the version (commit the result): recreate the wrapper
#                      module testbin/crane through the Go module proxy
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB="$ROOT/testbin/crane"
CRANE=v0.22.1
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"
go_env
need_go

if [[ ${1:-} == --init ]]; then
  (cd "$ROOT/testbin" && rm -rf crane && mkdir crane && cd crane \
    && go mod init testbin/crane \
    && go get -tool "github.com/google/go-containerregistry/cmd/crane@$CRANE" \
    && go mod tidy)
  say "init done: commit testbin/crane"
  exit 0
fi

KEY=$({
  go version
  echo "$CRANE"
  cat "$TB/go.mod" "$TB/go.sum"
  grep -v '^[[:space:]]*#' "$0" # the build commands below (comments aside)
} | sha256sum | cut -c1-16)
BASE=$(cache_root CRANE_CACHE crane)
DEST="$BASE/$KEY"
mkdir -p "$DEST"
exec 9>"$BASE/.lock"
flock 9 # one builder at a time; a waiter then finds the binary built
if [[ -x $DEST/crane ]]; then
  say "cached ($DEST)"
else
  scratch_dir "$BASE" build
  say "building crane $CRANE from testbin/crane…"
  (cd "$TB" && nice -n 10 go build -trimpath -ldflags "-s -w" -o "$SCRATCH/crane" \
    github.com/google/go-containerregistry/cmd/crane)
  mv -f "$SCRATCH/crane" "$DEST/crane"
  say "built in $((SECONDS - START))s"
fi
got=$("$DEST/crane" version 2>&1)
[[ $got == "$CRANE" ]] || die "unexpected crane version: $got"
echo "$DEST"
