#!/usr/bin/env bash
# The install steps of the Dockerfile, runnable (and tested) without a Docker engine.
#
#   scripts/docker-install.sh wheel    OUTDIR   build the malleus wheel into OUTDIR
#   scripts/docker-install.sh operator WHEELDIR install malleus[operator] from WHEELDIR: no torch
#   scripts/docker-install.sh trainer  WHEELDIR install torch==$TORCH_VERSION, then malleus[trainer]
#   scripts/docker-install.sh check    operator|trainer
#                                               run the image's entrypoint --help and import checks
#   scripts/docker-install.sh rdma     [ROOT]   install the RDMA user-space libraries (Debian's
#                                               rdma-core: libibverbs1, ibverbs-providers,
#                                               librdmacm1) into the image, or, with ROOT, unpack
#                                               them there without root (a check of the packages);
#                                               then load libibverbs.so.1 as NCCL does
#
# Environment: PYTHON (default python3), TORCH_VERSION (2.13.0), TORCH_INDEX_URL (empty: PyPI,
# whose Linux wheels are CUDA builds; a CPU-only image passes the PyTorch CPU wheel index),
# MALLEUS_PIP (the pip command; default "$PYTHON -m pip"), MALLEUS_PIP_ARGS (extra pip install
# arguments; the tests pass --no-deps --no-index to install offline against already-installed
# dependencies), MALLEUS_WHEEL_ARGS (extra pip wheel arguments).
set -euo pipefail

python=${PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
read -r -a pip <<<"${MALLEUS_PIP:-$python -m pip}"
read -r -a pip_args <<<"${MALLEUS_PIP_ARGS:-}"
read -r -a wheel_args <<<"${MALLEUS_WHEEL_ARGS:-}"
pip_install=("${pip[@]}" install --no-cache-dir --disable-pip-version-check "${pip_args[@]}")
here=$(cd "$(dirname "$0")/.." && pwd)

wheel_of() {
  local dir=$1 found
  found=$(ls "$dir"/malleus-*.whl 2>/dev/null | head -n 1)
  [[ -n $found ]] || { echo "docker-install: no malleus wheel in $dir" >&2; exit 1; }
  echo "$found"
}

check() {
  case $1 in
    operator)
      "$python" -m malleus.operator --help >/dev/null
      "$python" - <<'PY'
import sys
import malleus.operator.handlers  # noqa: F401  (every handler module, kopf and the client)
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not bad, f"the operator imported torch: {bad[:5]}"
print("docker-install: operator OK (no torch imported)")
PY
      ;;
    trainer)
      "$python" -m malleus.trainer --help >/dev/null
      # torch.distributed.run is what the `torchrun` command (the worker pods' entry) runs
      "$python" -c "import torch, torch.distributed.run, malleus.trainer.cli; print('docker-install: trainer OK, torch', torch.__version__)"
      ;;
    *) echo "docker-install: check operator|trainer" >&2; exit 2 ;;
  esac
}

case ${1:-} in
  wheel)
    out=${2:?usage: $0 wheel OUTDIR}
    mkdir -p "$out"
    "${pip[@]}" wheel --no-cache-dir --disable-pip-version-check --no-deps \
      "${wheel_args[@]}" -w "$out" "$here"
    ;;
  operator)
    wheel=$(wheel_of "${2:?usage: $0 operator WHEELDIR}")
    "${pip_install[@]}" "${wheel}[operator]"
    check operator
    ;;
  trainer)
    wheel=$(wheel_of "${2:?usage: $0 trainer WHEELDIR}")
    if ! "$python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
      index=()
      [[ -n ${TORCH_INDEX_URL:-} ]] && index=(--index-url "$TORCH_INDEX_URL")
      "${pip_install[@]}" "${index[@]}" "torch==$torch_version"
    fi
    "${pip_install[@]}" "${wheel}[trainer]"
    check trainer
    ;;
  check)
    check "${2:?usage: $0 check operator|trainer}"
    ;;
  rdma)
    # NCCL's InfiniBand/RoCE transport dlopens libibverbs.so.1; the providers (mlx5, efa, ...)
    # are the plugins it loads for the NIC found. Nothing else of rdma-core is needed in a pod.
    packages=(libibverbs1 ibverbs-providers librdmacm1)
    root=${2:-}
    if [[ -z $root ]]; then
      apt-get update
      apt-get install -y --no-install-recommends "${packages[@]}"
      rm -rf /var/lib/apt/lists/*
      lib=$(ldconfig -p | awk '/libibverbs\.so\.1 /{print $NF; exit}')
    else  # no root: the .debs (and their library dependencies) unpacked into ROOT
      mkdir -p "$root/debs"
      (cd "$root/debs" && apt-get download "${packages[@]}" libnl-3-200 libnl-route-3-200)
      for deb in "$root"/debs/*.deb; do dpkg-deb -x "$deb" "$root"; done
      export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu"
      lib=$root/usr/lib/x86_64-linux-gnu/libibverbs.so.1
    fi
    [[ -n $lib && -e $lib ]] || { echo "docker-install: libibverbs.so.1 not installed" >&2; exit 1; }
    "$python" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('docker-install: rdma OK,', sys.argv[1])" "$lib"
    ;;
  *)
    sed -n '2,18p' "$0" >&2
    exit 2
    ;;
esac
