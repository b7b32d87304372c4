#!/usr/bin/env bash
# Fetches (once) Alertmanager 0.25 and amtool from Debian's `prometheus-alertmanager` package,
# unpacked into a cache outside the repo keyed by the package version, and prints the directory
# that holds them (the last line of stdout; everything else goes to stderr). The end-to-end alert
# chain (tests/integration/test_alert_chain.py) runs this alertmanager.
# Idempotent: a warm cache costs two --version calls.
#
#   ALERTMANAGER_CACHE=/dir   cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-alertmanager)
#
# Nothing is installed system-wide: `apt-get download` fetches the .deb (verified by apt against
# the signed archive index) and `dpkg-deb -x` unpacks it. The package's dependencies (adduser,
# tzdata, init-system-helpers) serve only its systemd service and user; the binaries are Go,
# linked against libc only. Why Debian's and not the Go module: v0.35.0 does not build from the
# module (its UI assets are not in it).
#
# Debian's build reads its notification templates from a path compiled into the binary,
# /usr/share/prometheus/alertmanager/default.tmpl (no flag moves it; without the file every
# config load fails: "failed to parse templates"). So `alertmanager` here is a wrapper: unless the
# package is installed, it runs the real binary (libexec/) in a private mount namespace where an
# overlay shows this package's share/ inside /usr/share. The host's /usr/share is untouched.
# That takes root (CI) or, as another user, an unprivileged user namespace.
set -euo pipefail
PACKAGE=prometheus-alertmanager
VERSION=0.25.0-1+b4 # Debian 12 (bookworm); the binary reports 0.25.0
UPSTREAM=0.25.0
# shellcheck source=scripts/ensure-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/ensure-lib.sh"

BASE=$(cache_root ALERTMANAGER_CACHE alertmanager)
DEST="$BASE/$VERSION"
mkdir -p "$BASE"

if [[ -x $DEST/alertmanager && -x $DEST/libexec/alertmanager && -x $DEST/amtool ]]; then
  say "cached ($DEST)"
else
  need_tools "needs a Debian-based system" apt-get dpkg-deb
  scratch_dir "$BASE" fetch
  # As root, apt warns that it downloads "unsandboxed" (its `_apt` user cannot enter ~root):
  # harmless, the .deb is still checked against the signed index.
  say "downloading $PACKAGE=$VERSION…"
  if ! (cd "$SCRATCH" && apt-get download -q "$PACKAGE=$VERSION") >&2; then
    # A fresh container has no package lists: update them, once, only when the download failed.
    say "download failed; running apt-get update and retrying"
    apt-get update -q >&2
    (cd "$SCRATCH" && apt-get download -q "$PACKAGE=$VERSION") >&2
  fi
  debs=("$SCRATCH"/"${PACKAGE}"_*.deb)
  [[ -f ${debs[0]} ]] || die "apt-get download left no .deb in $SCRATCH"
  dpkg-deb -x "${debs[0]}" "$SCRATCH/root"
  mkdir -p "$SCRATCH/out/libexec" "$SCRATCH/out/share/prometheus"
  mv "$SCRATCH/root/usr/bin/prometheus-alertmanager" "$SCRATCH/out/libexec/alertmanager"
  mv "$SCRATCH/root/usr/bin/amtool" "$SCRATCH/out/amtool"
  mv "$SCRATCH/root/usr/share/prometheus/alertmanager" "$SCRATCH/out/share/prometheus/"
  cat >"$SCRATCH/out/alertmanager" <<'WRAPPER'
#!/bin/sh
# Debian's alertmanager with its templates at the compiled-in path (scripts/ensure-alertmanager.sh).
here=$(dirname "$(readlink -f "$0")")
real="$here/libexec/alertmanager"
if [ -f /usr/share/prometheus/alertmanager/default.tmpl ]; then exec "$real" "$@"; fi
if [ "$(id -u)" -eq 0 ]; then ns="--mount"; else ns="--user --map-root-user --mount"; fi
# shellcheck disable=SC2086 # $ns is a list of flags
exec unshare $ns --propagation private -- sh -c \
  'mount -t overlay gpuguard-alertmanager -o "lowerdir=$1:/usr/share" /usr/share && shift && exec "$@"' \
  sh "$here/share" "$real" "$@"
WRAPPER
  chmod 0755 "$SCRATCH/out/alertmanager"
  rm -rf "$DEST"
  mv "$SCRATCH/out" "$DEST" # one rename: the entry is complete or absent
  say "fetched in $((SECONDS - START))s"
fi
expect_version "$DEST/alertmanager" "version $UPSTREAM "
say "$("$DEST/amtool" --version 2>&1 | head -1)"
hand_over "$DEST" "$BASE"
