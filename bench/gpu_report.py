"""bench/gpu.sh's helpers that must run before anything of Malleus imports: the install from
wheels, the import check, and the summary against the targets. Standard library only.

    python bench/gpu_report.py install WHEELS SITE  # every wheel of WHEELS into SITE, no network
    python bench/gpu_report.py env                  # what imports, from where, which versions
    python bench/gpu_report.py summary OUT          # OUT/gpu-*.json against the targets

*install* runs `pip install --no-index --no-deps --target SITE` over the wheels (pip checks their
tags against this interpreter); without pip it unpacks them, which for these wheels (no scripts,
no headers) is the same install. *env* imports what the stages need, the image's packages first,
and exits 1 naming every module that is missing and who needs it, so a bare machine fails here
in seconds rather than in every stage; it also says whether the installed Malleus is the tree's
(a wheel built before the last edit measures old code).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ["torch", "numpy", "yaml", "safetensors", "httpx", "prometheus_client", "transformers"]
"""What the lent machine's image must have (issue 29), and pytest for the CUDA tests."""
MALLEUS = [
    "malleus.job",
    "malleus.planner",
    "malleus.control",
    "malleus.trainer.engine.trainer",
    "malleus.trainer.run.loop",
    "malleus.trainer.launch.spawn",
    "malleus.trainer.model.hf",
]
"""What bench/gpu.py and the CUDA tests import of Malleus (and, through it, the wheels)."""
MAPPED = {"trainer": "trainer", "operator": "operator"}  # malleus/<sub> -> the tree's folder
TARGET_MFU = 0.40  # the ~1.1B model on one H200 (issue 29)
TARGET_RATIO = 1.10  # trainer step time / plain step time


def install(wheels: Path, site: Path) -> int:
    found = sorted(wheels.glob("*.whl"))
    if not any(w.name.startswith("malleus-") for w in found):
        print(
            f"install: no malleus wheel in {wheels}: run scripts/gpu-wheels.sh where the tree is "
            "and carry its folder (docs/benchmarks.md, GPU)",
            file=sys.stderr,
        )
        return 1
    site.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
        cmd += ["--disable-pip-version-check", "--target", str(site), *map(str, found)]
        return subprocess.run(cmd).returncode
    print("install: this Python has no pip: unpacking the wheels")
    for wheel in found:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        for data in site.glob("*.data"):  # purelib / platlib belong at the top
            for lib in ("purelib", "platlib"):
                if (data / lib).is_dir():
                    shutil.copytree(data / lib, site, dirs_exist_ok=True)
            shutil.rmtree(data)
        print(f"install: {wheel.name}")
    return 0


def env() -> int:
    """Import what the stages need; print versions and where each came from."""
    print(f"python {sys.version.split()[0]} at {sys.executable}")
    missing: list[str] = []
    for name in [*IMAGE, "pytest", *MALLEUS]:
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            needed = getattr(e, "name", None) or name
            who = "the image" if name in IMAGE or name == "pytest" else f"{name}"
            missing.append(f"{needed} (needed by {who}): {type(e).__name__}: {e}")
            continue
        version = getattr(mod, "__version__", "")
        where = getattr(mod, "__file__", None) or list(getattr(mod, "__path__", []))
        print(f"ok {name} {version} from {where}")
    if missing:
        print("MISSING: " + "; ".join(missing), file=sys.stderr)
        print(
            "a module the image lacks belongs in bench/gpu-wheels.txt (scripts/gpu-wheels.sh)",
            file=sys.stderr,
        )
        return 1
    import torch

    cuda = torch.version.cuda
    print(f"torch {torch.__version__} cuda {cuda} available {torch.cuda.is_available()}")
    stale = stale_files()
    if stale is None:
        print("malleus: the tree itself (an editable install)")
    elif stale:
        print(f"WARNING: the installed malleus differs from the tree in {len(stale)} files, e.g. "
              f"{', '.join(stale[:5])}: rebuild it with scripts/gpu-wheels.sh")  # fmt: skip
    else:
        print("malleus: the installed wheel matches the tree")
    return 0


def stale_files() -> list[str] | None:
    """Files where the installed malleus and the tree differ (None: it is the tree)."""
    spec = importlib.util.find_spec("malleus.trainer")
    assert spec is not None and spec.submodule_search_locations
    trainer = Path(next(iter(spec.submodule_search_locations))).resolve()
    if trainer == (ROOT / "trainer").resolve():
        return None
    installed = trainer.parent
    differ = []
    for path in sorted(installed.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(installed)
        top = MAPPED.get(rel.parts[0]) if len(rel.parts) > 1 else None
        tree = ROOT / top / Path(*rel.parts[1:]) if top else ROOT / "malleus" / rel
        if not tree.is_file() or tree.read_bytes() != path.read_bytes():
            differ.append(str(rel))
    for folder, sub in [("malleus", ""), *((v, k) for k, v in MAPPED.items())]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = (
                Path(sub, path.relative_to(ROOT / folder))
                if sub
                else path.relative_to(ROOT / folder)
            )
            if "__pycache__" not in path.parts and not (installed / rel).is_file():
                differ.append(str(rel))
    return differ


def summary(out: Path) -> int:
    """One line per measured figure, against the targets; dry runs are marked, not judged."""
    runs = {}
    for mode in ("solo", "plain", "share", "compiled"):
        f = out / f"gpu-{mode}.json"
        if f.is_file():
            runs[mode] = json.loads(f.read_text())
    dry = any(r.get("dry_run") for r in runs.values())

    def verdict(ok: bool) -> str:
        return "dry run, not judged" if dry else ("met" if ok else "NOT met")

    def mfu(r: dict) -> str:
        return "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"

    for mode in ("solo", "plain"):
        if mode in runs:
            r = runs[mode]
            line = f"{mode}: {r['tokens_per_second']:,.0f} tokens/s, MFU {mfu(r)}"
            if mode == "solo" and r.get("mfu") is not None:
                line += f" (target >= {100 * TARGET_MFU:.0f}%: {verdict(r['mfu'] >= TARGET_MFU)})"
            print(line)
    if "solo" in runs and "plain" in runs:
        ratio = runs["solo"]["step_seconds"] / runs["plain"]["step_seconds"]
        print(
            f"trainer/plain step time: {ratio:.3f} "
            f"(target <= {TARGET_RATIO:.2f}: {verdict(ratio <= TARGET_RATIO)})"
        )
    if "compiled" in runs:
        r = runs["compiled"]
        line = f"compiled: {r['tokens_per_second']:,.0f} tokens/s, MFU {mfu(r)}"
        if r.get("mfu") is not None:
            line += f" (target >= {100 * TARGET_MFU:.0f}%: {verdict(r['mfu'] >= TARGET_MFU)})"
        if "solo" in runs:
            line += f"; {runs['solo']['step_seconds'] / r['step_seconds']:.2f}x solo's speed"
        print(line)
    if "share" in runs:
        r = runs["share"]
        line = f"share: {r['ranks']} jobs, {r['tokens_per_second']:,.0f} tokens/s in all"
        if "solo" in runs:
            line += f" ({r['tokens_per_second'] / runs['solo']['tokens_per_second']:.2f} of solo)"
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("wheels", type=Path)
    p.add_argument("site", type=Path)
    sub.add_parser("env")
    p = sub.add_parser("summary")
    p.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "install":
        return install(args.wheels, args.site)
    if args.cmd == "env":
        return env()
    return summary(args.out)


if __name__ == "__main__":
    sys.exit(main())
