#!/usr/bin/env bash
# Put Debian's `prometheus` and `promtool` (2.42) into DEST/usr/bin, unpacked from the .deb
# without a system install (`apt-get download` needs no root; the binaries are static Go).
# Tests read MALLEUS_PROMETHEUS=DEST/usr/bin/prometheus and MALLEUS_PROMTOOL=DEST/usr/bin/promtool
# and skip, with a reason, when they are unset.
#   scripts/prometheus-bin.sh .cache/prometheus
set -euo pipefail
DEST=${1:?usage: scripts/prometheus-bin.sh DEST}
bin=$DEST/usr/bin
if [[ -x $bin/prometheus && -x $bin/promtool ]] && "$bin/promtool" --version >/dev/null 2>&1; then
  echo "prometheus-bin: $bin/prometheus and $bin/promtool already present"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# apt-get download writes into the working directory; an empty package cache needs an update.
(cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 ||
  { apt-get update -qq >/dev/null 2>&1 || true; apt-get download prometheus; }; })
deb=$(ls "$tmp"/prometheus_*.deb)
mkdir -p "$DEST"
dpkg-deb -x "$deb" "$DEST"
version=$("$bin/prometheus" --version 2>&1)
echo "${version%%$'\n'*}"
echo "prometheus-bin: $bin ready (export MALLEUS_PROMETHEUS=$bin/prometheus MALLEUS_PROMTOOL=$bin/promtool)"
