#!/usr/bin/env bash
# Unpack the test Kubernetes binaries into DEST, executable, for tests that read
# MALLEUS_K8S_ASSETS=DEST: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok, kueue (the real control plane, tests/cluster), and Kueue's CRDs and webhook
# configurations into DEST/kueue-manifests (tests/cluster/kueue.py). The packed binaries live in
# shared/k8s/bin beside the repository, Kueue's manifests in shared/k8s/kueue (read-only there,
# hence the copy; NAME.xz or NAME.gz); SRC overrides the bin folder (its ../kueue the manifests).
#   scripts/k8s-assets.sh /tmp/k8s-assets && export MALLEUS_K8S_ASSETS=/tmp/k8s-assets
set -euo pipefail
DEST=${1:?usage: scripts/k8s-assets.sh DEST [SRC]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=${2:-$here/../../shared/k8s/bin}
[ -d "$SRC" ] || { echo "k8s-assets: no folder $SRC (pass SRC as the second argument)" >&2; exit 1; }
mkdir -p "$DEST"
for name in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok kueue; do
  if [ -f "$SRC/$name.xz" ]; then packed=$SRC/$name.xz; unpack=(xz -dc)
  elif [ -f "$SRC/$name.gz" ]; then packed=$SRC/$name.gz; unpack=(gunzip -c)
  else echo "k8s-assets: neither $SRC/$name.xz nor $SRC/$name.gz exists" >&2; exit 1; fi
  # Skip the unpacking when DEST already holds this very binary (CI reruns, local loops).
  if [ -x "$DEST/$name" ] && [ "$DEST/$name" -nt "$packed" ]; then continue; fi
  "${unpack[@]}" "$packed" > "$DEST/$name.tmp"
  chmod 0755 "$DEST/$name.tmp"
  mv -f "$DEST/$name.tmp" "$DEST/$name"
done
# Kueue's CRDs and webhook configurations (tests/cluster/kueue.py applies them)
if [ -d "$SRC/../kueue/crd" ] && [ -f "$SRC/../kueue/webhook/manifests.yaml" ]; then
  rm -rf "$DEST/kueue-manifests.tmp"
  mkdir -p "$DEST/kueue-manifests.tmp"
  cp -R "$SRC/../kueue/crd" "$SRC/../kueue/webhook" "$DEST/kueue-manifests.tmp/"
  rm -rf "$DEST/kueue-manifests"
  mv "$DEST/kueue-manifests.tmp" "$DEST/kueue-manifests"
else
  echo "k8s-assets: no $SRC/../kueue/{crd,webhook}: the Kueue tests will skip" >&2
fi
version=$("$DEST/etcd" --version)  # no pipe into head: with pipefail, SIGPIPE would fail it
echo "${version%%$'\n'*}"
version=$("$DEST/kube-apiserver" --version)
echo "$version"
echo "k8s-assets: $DEST ready (export MALLEUS_K8S_ASSETS=$DEST)"
