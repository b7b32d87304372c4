#!/usr/bin/env bash
# `make push-image`: pushes the image `make image` built (build/gpuguard-image.oci.tar, an OCI
# image layout archive) to a registry without Docker, with crane (go-containerregistry's client,
# built once by scripts/ensure-crane.sh), then reads the pushed manifest's digest back and checks
# it is the archive's, and prints the chart values that deploy it.
#
# crane pushes an OCI layout directory as it is (the archive's manifest bytes, so the digest a
# node pulls is the one built); the archive is unpacked into a scratch directory for it. It
# logs in with Docker's credential file (~/.docker/config.json, or $DOCKER_CONFIG): `crane auth
# login REGISTRY -u USER --password-stdin` writes it, without Docker. Registries on localhost or
# a loopback address are spoken to over plain HTTP, others over HTTPS.
#
# Needs: Go 1.26 (the first run builds crane), python3, network to the registry. Not root.
# Progress goes to stderr; the last line of stdout is REPOSITORY:TAG@DIGEST.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ARCHIVE=${IMAGE_ARCHIVE:-$ROOT/build/gpuguard-image.oci.tar}
REPOSITORY=${IMAGE_REPOSITORY:-}
CHART="$ROOT/helm/gpuguard/Chart.yaml"
APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART")
TAG=${IMAGE_TAG:-$APP_VERSION}
START=$SECONDS

say() { printf '[push-image %4ds] %s\n' "$((SECONDS - START))" "$*" >&2; }
die() {
  say "$*"
  exit 1
}

usage() {
  cat <<EOF
usage: IMAGE_REPOSITORY=REGISTRY/PATH [IMAGE_TAG=TAG] [IMAGE_ARCHIVE=FILE] scripts/push-image.sh
       (or: make push-image IMAGE_REPOSITORY=REGISTRY/PATH [IMAGE_TAG=TAG])
Pushes IMAGE_ARCHIVE (default build/gpuguard-image.oci.tar, from 'make image') to
IMAGE_REPOSITORY:IMAGE_TAG with crane (IMAGE_TAG defaults to the chart's appVersion,
$APP_VERSION), checks the pushed digest, and prints the chart's values for it:
  --set image.repository=IMAGE_REPOSITORY --set image.tag=IMAGE_TAG
Credentials: crane auth login REGISTRY -u USER --password-stdin (Docker's config file).
EOF
}

case ${1:-} in
  -h | --help)
    usage
    exit 0
    ;;
  "") ;;
  *)
    usage >&2
    exit 2
    ;;
esac
if [[ -z $REPOSITORY ]]; then
  usage >&2
  die "IMAGE_REPOSITORY is not set"
fi
[[ $REPOSITORY != *@* && ${REPOSITORY##*/} != *:* ]] \
  || die "IMAGE_REPOSITORY=$REPOSITORY: a repository without tag or digest (IMAGE_TAG is the tag)"
[[ -f $ARCHIVE ]] || die "no image archive $ARCHIVE: build it with make image"

CRANE_DIR=$(bash "$ROOT/scripts/ensure-crane.sh" | tail -1)
CRANE="$CRANE_DIR/crane"
[[ -x $CRANE ]] || die "scripts/ensure-crane.sh did not print its directory"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpuguard-push.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
tar -xf "$ARCHIVE" -C "$WORK"
DIGEST=$(python3 - "$WORK/index.json" <<'EOF'
import json, sys

manifests = json.load(open(sys.argv[1]))["manifests"]
if len(manifests) != 1:
    sys.exit(f"the archive holds {len(manifests)} images, not one")
print(manifests[0]["digest"])
EOF
) || die "$ARCHIVE is not an OCI image archive of one image"

REF="$REPOSITORY:$TAG"
say "pushing $ARCHIVE ($DIGEST) to $REF…"
"$CRANE" push "$WORK" "$REF" >/dev/null
PUSHED=$("$CRANE" digest "$REF")
[[ $PUSHED == "$DIGEST" ]] || die "$REF has digest $PUSHED, the archive $DIGEST"
say "pushed: $REF@$PUSHED (the archive's digest)"
say "deploy it: helm upgrade --install ... --set image.repository=$REPOSITORY --set image.tag=$TAG"
echo "$REF@$PUSHED"
