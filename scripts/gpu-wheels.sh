#!/usr/bin/env bash
# Prepare here what bench/gpu.sh needs on a bare lent GPU machine, where nothing can be fetched
# and a .venv made here does not run (its Python is 3.12, ours 3.11): wheels of every package in
# bench/gpu-wheels.txt (what the trainer path imports and the machine's image lacks), for CPython
# 3.12 on manylinux x86_64, and a wheel of Malleus built from this working tree.
#
#   scripts/gpu-wheels.sh [DEST [PYTHON_VERSION]]    # default: .gpu-wheels 3.12
#
# (a relative DEST is taken from the repository root), then, on the lent machine, the device
# tool's run with carry [".gpu-wheels"] and the command `bash bench/gpu.sh` (docs/benchmarks.md).
# Wheels already in DEST are kept, so a second run needs no network; the Malleus wheel is
# rebuilt every time (from a copy of the tracked and untracked-not-ignored files, so that no
# stale build/ leaks in). DEST holds wheels for one
# Python version (DEST/.python-version); asked for another, it is emptied first. Fails when
# DEST grows past MAX_MIB (the tree and the carried folders travel in 64 MiB all together).
# PYTHON picks the interpreter that runs pip (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-wheels}
pyver=${2:-3.12}
MAX_MIB=32
py=${PYTHON:-}
if [[ -z $py ]]; then
  py=python3
  [[ -x .venv/bin/python ]] && py=.venv/bin/python
fi
pip=("$py" -m pip --disable-pip-version-check)

mkdir -p "$dest"
if [[ -f $dest/.python-version && $(cat "$dest/.python-version") != "$pyver" ]]; then
  rm -f "$dest"/*.whl
fi
echo "$pyver" >"$dest/.python-version"

# The pins without a wheel in DEST yet (name and version as the wheel file spells them).
todo=$("$py" - "$dest" bench/gpu-wheels.txt <<'PY'
import re, sys
from pathlib import Path
dest, listing = Path(sys.argv[1]), Path(sys.argv[2])
have = {tuple(w.name.lower().split("-")[:2]) for w in dest.glob("*.whl")}
for line in listing.read_text().splitlines():
    pin = line.split("#")[0].strip()
    if pin:
        name, version = pin.split("==")
        if (re.sub(r"[-_.]+", "_", name).lower(), version.lower()) not in have:
            print(pin)
PY
)
missing=()
[[ -n $todo ]] && mapfile -t missing <<<"$todo"
if ((${#missing[@]})); then
  major=${pyver%%.*} minor=${pyver#*.}
  "${pip[@]}" download --quiet --no-deps --only-binary=:all: --dest "$dest" \
    --python-version "$pyver" --implementation cp --abi "cp$major$minor" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "${missing[@]}"
fi

# Malleus itself, from the files git would commit (tracked, and untracked but not ignored).
rm -f "$dest"/malleus-*.whl
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -z -co --exclude-standard -- pyproject.toml README.md malleus trainer operator |
  while IFS= read -r -d '' f; do if [[ -e $f ]]; then printf '%s\0' "$f"; fi; done |
  tar --null -T - -cf - | tar -xf - -C "$src"
"${pip[@]}" wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dest" "$src" >/dev/null

bytes=$(du -sb "$dest" | cut -f1)
count=$(find "$dest" -name '*.whl' | wc -l)
mib=$(((bytes + (1 << 20) - 1) >> 20))
echo "gpu-wheels: $count wheels for Python $pyver in $dest, $mib MiB"
if ((mib > MAX_MIB)); then
  echo "gpu-wheels: $dest is over $MAX_MIB MiB: it would not travel with the tree" >&2
  exit 1
fi
