#!/usr/bin/env bash
# Builds (once) a Python base image from Debian's packages, without a registry (`make
# python-base`; then `make image BASE_ARCHIVE=build/python-base.oci.tar`, scripts/build-image.sh):
# a Debian 12 (bookworm) rootfs with python3, python3-venv, ca-certificates
# and apt (the Dockerfile's build stage apt-gets the C compiler, as on the official image), made
# by mmdebstrap and turned into an OCI image layout + archive by scripts/rootfs_to_oci.py, cached
# outside the repo keyed by suite + mirrors + packages + mmdebstrap version + the CA bundle below
# + rootfs_to_oci.py + this script's commands:
#
#   <dir>/layout/               OCI image layout
#   <dir>/python-base.oci.tar   the same layout as an archive: build-image.sh's BASE_ARCHIVE (the
#                               Dockerfile's PYTHON_IMAGE through a named context), and the
#                               real-node test's tenant image (ctr -n k8s.io images import)
#   <dir>/digest, <dir>/name    the manifest digest and the image name inside
#
# It takes the place of the Dockerfile's default python:3.11.11-slim-bookworm where no registry
# is reachable, for the tests and for a cluster image alike: `/usr/local` is made a venv (`python3 -m venv /usr/local`, pip from Debian's python3-pip-whl), so the Dockerfile's
# `pip install --prefix=/install` then `COPY --from=build /install /usr/local` land where the venv's
# python looks, and the console script's shebang (#!/usr/local/bin/python3) resolves in the final
# stage, exactly as on the official image. Debian's python3 is 3.11.2, not 3.11.11; its Debian
# packages are those of the day the cache entry was built (PYTHON_BASE_CACHE= elsewhere rebuilds).
#
# pip's CA bundle: where the build host's pip is configured with one (`pip config get
# global.cert`, e.g. behind a TLS-inspecting proxy), it is copied into the image as
# /etc/ssl/certs/build-host-ca-bundle.crt and /etc/pip.conf points pip's `cert` at it, so the
# Dockerfile's RUN pip install reaches PyPI inside BuildKit the way the host does. Both files stay
# in the images built on this base; PYTHON_BASE_CA_BUNDLE="" leaves them out.
#
# mmdebstrap 1.3.5 comes the way the other scripts fetch Debian tools: `apt-get download`
# (verified by apt against the signed archive index) and `dpkg-deb -x` into the cache, run with
# the machine's perl (its dependencies apt, perl and python3 are on every Debian machine; nothing
# is installed system-wide). Root mode: needs root (mount, chroot) and reaches deb.debian.org.
#
# Under a lock (parallel runs wait for each other), written into scratch names and renamed last.
# Idempotent: a warm cache costs a hash. The last line of stdout is `PYTHON_BASE=<dir>`;
# everything else goes to stderr.
#
# Measured 2026-12-05 on the 2-vCPU CI machine kind (shared with Go builds, load ~17): cold
# 138 s and 158 s (mmdebstrap 116-144 s incl. downloading ~40 MB of .debs, layout + archive
# 14-17 s); rootfs 171 MB, layer 58 MB gzipped; the same digest both times (SOURCE_DATE_EPOCH=0).
# With apt added (2026-12-06, load ~1): 32 s (mmdebstrap 26 s), rootfs 188 MB, layer 65 MB gzipped.
# Warm: a hash.
#
#   PYTHON_BASE_CACHE=/dir      cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-image)
#   PYTHON_BASE_NAME=NAME:TAG   image name (default docker.io/library/gpuguard-python-base:test)
#   PYTHON_BASE_CA_BUNDLE=FILE  CA bundle pip trusts in the image ("" for none; see above)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SUITE=bookworm
MMDEBSTRAP=1.3.5-7 # Debian 12 (bookworm)
PACKAGES=python3,python3-venv,ca-certificates,apt
MIRRORS=(
  "deb http://deb.debian.org/debian $SUITE main"
  "deb http://deb.debian.org/debian $SUITE-updates main"
  "deb http://deb.debian.org/debian-security $SUITE-security main"
)
NAME=${PYTHON_BASE_NAME:-docker.io/library/gpuguard-python-base:test}
PIP_CERT=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
CA=${PYTHON_BASE_CA_BUNDLE-${PIP_CERT:-}}
START=$SECONDS

say() { printf '[ensure-python-base %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() { say "$*"; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (mmdebstrap's root mode: mount, chroot)"
for tool in apt-get dpkg-deb perl python3 flock; do
  command -v "$tool" >/dev/null || die "$tool not found (needs a Debian machine)"
done
[[ -z $CA || -f $CA ]] || die "CA bundle $CA not found (PYTHON_BASE_CA_BUNDLE= for none)"

KEY=$({
  echo "$SUITE $MMDEBSTRAP $PACKAGES $NAME"
  printf '%s\n' "${MIRRORS[@]}"
  [[ -z $CA ]] || sha256sum <"$CA"
  cat "$ROOT/scripts/rootfs_to_oci.py"
  grep -v '^[[:space:]]*#' "$0" # the build commands below (comments aside)
} | sha256sum | cut -c1-16)
BASE="${PYTHON_BASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpuguard-image}"
DEST="$BASE/python-base-$KEY"
mkdir -p "$BASE"
exec 9>"$BASE/.lock"
flock 9 # one builder at a time; a waiter then finds the base built
if [[ -f $DEST/digest ]]; then
  say "cached: $NAME $(cat "$DEST/digest")"
  echo "PYTHON_BASE=$DEST"
  exit 0
fi
TMP=$(mktemp -d "$BASE/.build.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

MM="$BASE/mmdebstrap-$MMDEBSTRAP"
if [[ ! -x $MM/usr/bin/mmdebstrap ]]; then
  (cd "$TMP" && apt-get download "mmdebstrap=$MMDEBSTRAP" >&2)
  dpkg-deb -x "$TMP"/mmdebstrap_*.deb "$TMP/mm"
  rm -rf "$MM"
  mv "$TMP/mm" "$MM"
  say "mmdebstrap $MMDEBSTRAP unpacked into $MM"
fi

# The customize hooks run on the host with the rootfs as $1. /etc/resolv.conf and /etc/hostname
# are the build host's (mmdebstrap copies them in for apt): the runtime provides its own.
# shellcheck disable=SC2016 # $1 is for the hook's shell
HOOKS=(
  --customize-hook='chroot "$1" python3 -m venv /usr/local'
  --customize-hook='chroot "$1" /usr/local/bin/pip --version'
  --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"'
)
if [[ -n $CA ]]; then
  cp "$CA" "$TMP/host-ca.crt"
  CERT=/etc/ssl/certs/build-host-ca-bundle.crt
  HOOKS+=(
    --customize-hook="upload $TMP/host-ca.crt $CERT"
    --customize-hook="printf '[global]\ncert = %s\n' $CERT >\"\$1/etc/pip.conf\""
  )
fi
say "mmdebstrap $SUITE: $PACKAGES…"
t0=$SECONDS
# SOURCE_DATE_EPOCH: mmdebstrap's tar then has fixed times (the digest follows the packages only).
# mmtarfilter (used for the path excludes) is found on PATH.
PATH="$MM/usr/bin:$PATH" SOURCE_DATE_EPOCH=0 nice -n 10 perl "$MM/usr/bin/mmdebstrap" \
  --mode=root --variant=essential --include="$PACKAGES" --skip=output/dev \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  "${HOOKS[@]}" "$SUITE" "$TMP/rootfs.tar" "${MIRRORS[@]}" >&2
say "rootfs: $(du -m "$TMP/rootfs.tar" | cut -f1) MB in $((SECONDS - t0))s"

t0=$SECONDS
mkdir "$TMP/out"
python3 "$ROOT/scripts/rootfs_to_oci.py" "$TMP/rootfs.tar" "$TMP/out/layout" --name "$NAME" \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --cmd python3 --archive "$TMP/out/python-base.oci.tar" >"$TMP/out/digest"
echo "$NAME" >"$TMP/out/name"
rm -rf "$DEST"
mv "$TMP/out" "$DEST"
say "OCI layout + archive in $((SECONDS - t0))s: $NAME $(cat "$DEST/digest")"
say "ready (total ${SECONDS}s)"
echo "PYTHON_BASE=$DEST"
