#!/usr/bin/env bash
# Unpack the test API server binaries (etcd, apiextensions-apiserver) into DEST, executable,
# for tests that read MALLEUS_K8S_ASSETS=DEST. The gzipped binaries live in shared/k8s/bin
# beside the repository (read-only there, hence the copy); SRC overrides that folder.
#   scripts/k8s-assets.sh /tmp/k8s-assets && export MALLEUS_K8S_ASSETS=/tmp/k8s-assets
set -euo pipefail
DEST=${1:?usage: scripts/k8s-assets.sh DEST [SRC]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${2:-$here/../../shared/k8s/bin}
[ -d "$SRC" ] || { echo "k8s-assets: no folder $SRC (pass SRC as the second argument)" >&2; exit 1; }
mkdir -p "$DEST"
for name in etcd apiextensions-apiserver; do
  [ -f "$SRC/$name.gz" ] || { echo "k8s-assets: $SRC/$name.gz is missing" >&2; exit 1; }
  # Skip the unpacking when DEST already holds this very binary (CI reruns, local loops).
  if [ -x "$DEST/$name" ] && [ "$DEST/$name" -nt "$SRC/$name.gz" ]; then continue; fi
  gunzip -c "$SRC/$name.gz" > "$DEST/$name.tmp"
  chmod 0755 "$DEST/$name.tmp"
  mv -f "$DEST/$name.tmp" "$DEST/$name"
done
version=$("$DEST/etcd" --version)  # no pipe into head: with pipefail, SIGPIPE would fail it
echo "${version%%$'\n'*}"
echo "k8s-assets: $DEST ready (export MALLEUS_K8S_ASSETS=$DEST)"
