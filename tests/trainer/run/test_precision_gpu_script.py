"""bench/gpu.sh end to end on CPU, and the wheels it carries to a bare GPU machine.

On a GPU machine the script measures a ~1.1B Llama; here `MALLEUS_GPU_DRY_RUN=1` runs the same
stages (the CUDA tests, skipped; one rank alone; the plain transformers loop; jobs sharing the
device) with a tiny model, so the script and its Python parts are known to work before a GPU is
at hand: once with this venv's Malleus, as a developer runs it, and once as a lent machine does.

A lent machine has its own Python 3.12 with torch, transformers and a few more, no Malleus and
no network (issue 29). scripts/gpu-wheels.sh prepares the wheels that travel; here they must
resolve for CPython 3.12 on manylinux x86_64, with nothing they need missing but what the image
has; and the same pins built for this machine's Python (scripts/test.sh prepares both folders)
must install with no network into a bare interpreter whose only packages are the image's (a
stand-in: links to this venv's copies of them), from which gpu.sh then runs every stage.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[3]
GPU_PY = "3.12"  # the lent machine's Python (issue 29)
HERE_PY = f"{sys.version_info.major}.{sys.version_info.minor}"
WHEELS = Path(os.environ.get("MALLEUS_GPU_WHEELS", ROOT / ".gpu-wheels"))
HERE_WHEELS = Path(
    os.environ.get("MALLEUS_GPU_TEST_WHEELS", ROOT / ".cache" / f"gpu-wheels-{HERE_PY}")
)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
IMAGE = ["torch", "transformers", "safetensors", "tokenizers", "pyarrow", "numpy", "httpx"]
IMAGE += ["pyyaml", "prometheus-client", "pytest", "pip"]
"""The lent machine's image (issue 29), with the pip its packages came with."""
MAX_MIB = 32  # scripts/gpu-wheels.sh's limit: the tree and what it carries travel in 64 MiB
PREPARE = "scripts/gpu-wheels.sh {folder} {py} (scripts/test.sh does before the suite)"


def pins() -> dict[str, str]:
    """bench/gpu-wheels.txt: canonical name -> pinned version."""
    out = {}
    for line in (ROOT / "bench" / "gpu-wheels.txt").read_text().splitlines():
        pin = line.split("#")[0].strip()
        if pin:
            name, version = pin.split("==")
            out[canonicalize_name(name)] = version
    return out


def prepared(folder: Path, py: str) -> list[Path]:
    """The folder's wheels, or a skip saying how to prepare it."""
    found = sorted(folder.glob("*.whl"))
    have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in found}
    missing = sorted((set(pins()) | {"malleus"}) - have)
    if missing:
        pytest.skip(f"{folder} lacks {missing[:3]}: run {PREPARE.format(folder=folder, py=py)}")
    return found


def isolated_env(**extra: str) -> dict[str, str]:
    """This environment without pip's settings (a configured find-links could serve a pin
    that the folder lacks) and without this venv on PATH or PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return env | {"PIP_CONFIG_FILE": os.devnull} | extra


def run_gpu_script(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    env = {"OUT": str(tmp_path), "MALLEUS_GPU_DRY_RUN": "1"} | env
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh")], env=env, capture_output=True, text=True
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, summary + done.stdout + done.stderr
    return done, summary


def check_figures(out: Path, share_ranks: int) -> None:
    summary = (out / "summary.txt").read_text()
    for stage in ("machine", "imports", "solo", "plain", "cuda-tests", "share"):
        assert f"{stage}: PASS" in summary, summary
    assert "skipped" in (out / "cuda-tests.txt").read_text()  # no CUDA here
    solo = json.loads((out / "gpu-solo.json").read_text())
    assert solo["tokens_per_second"] > 0 and 0 < solo["mfu"] < 1  # --peak-tflops 1 in dry runs
    plain = json.loads((out / "gpu-plain.json").read_text())
    assert plain["tokens_per_step"] == solo["tokens_per_step"] and 0 < plain["mfu"] < 1
    shared = json.loads((out / "gpu-share.json").read_text())
    assert len(shared["jobs"]) == share_ranks
    assert shared["tokens_per_second"] == sum(j["tokens_per_second"] for j in shared["jobs"])
    ratio = solo["step_seconds"] / plain["step_seconds"]
    assert f"trainer/plain step time: {ratio:.3f} (target <= 1.10: dry run" in summary, summary
    assert "(target >= 40%: dry run, not judged)" in summary, summary
    if shutil.which("cc") or shutil.which("gcc"):  # the compiled stage runs where it can
        assert "compiled: PASS" in summary, summary
        compiled = json.loads((out / "gpu-compiled.json").read_text())
        assert compiled["tokens_per_step"] == solo["tokens_per_step"]
        assert compiled["last_loss"] == pytest.approx(solo["last_loss"], rel=1e-3)
        assert "x solo's speed" in summary, summary


def test_gpu_script_dry_run(tmp_path: Path) -> None:
    """As a developer runs it: this venv's own Malleus, nothing installed."""
    env = os.environ | {"MALLEUS_GPU_SHARE_RANKS": "2", "PYTHON": sys.executable}
    run_gpu_script(tmp_path, **env)
    check_figures(tmp_path, 2)
    assert "install:" not in (tmp_path / "summary.txt").read_text()
    assert "malleus: the tree itself" in (tmp_path / "imports.txt").read_text()


# ---- the wheels that travel -----------------------------------------------------------------


def test_wheels_resolve_for_the_gpu_python(tmp_path: Path) -> None:
    """Every pin and Malleus have a wheel for CPython 3.12 on manylinux x86_64, in the folder
    itself, and the folder fits what travels."""
    found = prepared(WHEELS, GPU_PY)
    major, minor = GPU_PY.split(".")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index"]
    cmd += ["--no-deps", "--ignore-installed", "--find-links", str(WHEELS)]
    cmd += ["--only-binary=:all:", "--python-version", GPU_PY, "--implementation", "cp"]
    cmd += ["--abi", f"cp{major}{minor}", *(a for p in PLATFORMS for a in ("--platform", p))]
    cmd += ["--target", str(tmp_path / "target"), "--report", str(tmp_path / "report.json")]
    cmd += [f"{n}=={v}" for n, v in pins().items()] + ["malleus"]
    subprocess.run(cmd, env=isolated_env(), check=True, capture_output=True)
    report = json.loads((tmp_path / "report.json").read_text())
    chosen = {i["download_info"]["url"].rsplit("/", 1)[1] for i in report["install"]}
    assert chosen == {w.name for w in found}, chosen ^ {w.name for w in found}
    mib = sum(w.stat().st_size for w in found) / 2**20
    assert mib < MAX_MIB, f"{WHEELS}: {mib:.1f} MiB"


def test_wheels_close_over_their_dependencies() -> None:
    """What any wheel requires on Python 3.12 / Linux is another wheel of the folder, in the
    versions asked, or a package of the image: `--no-deps` there leaves nothing out."""
    found = prepared(WHEELS, GPU_PY)
    versions = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in found}
    image = {canonicalize_name(n) for n in IMAGE}
    marker_env = {"python_version": GPU_PY, "python_full_version": f"{GPU_PY}.0"}
    marker_env |= {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix"}
    marker_env |= {"platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    unmet = []
    for wheel in found:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            headers = Parser().parsestr(z.read(meta).decode())
        for line in headers.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(marker_env):
                continue
            dep = canonicalize_name(req.name)
            if dep in image:
                continue
            have = versions.get(dep)
            if have is None or not req.specifier.contains(
                parse_wheel_filename(have.name)[1], prereleases=True
            ):
                unmet.append(f"{name} {version} needs {req}")
    assert not unmet, unmet


def test_wheels_here_are_the_same_pins() -> None:
    """The set installed below for this machine's Python is the traveling set, but for the
    binary wheels' tags."""
    there, here = prepared(WHEELS, GPU_PY), prepared(HERE_WHEELS, HERE_PY)
    strip = lambda ws: {parse_wheel_filename(w.name)[:2] for w in ws}  # noqa: E731
    assert strip(there) == strip(here)


# ---- a bare interpreter with the image's packages, as on the lent machine --------------------


def image_site(dest: Path) -> Path:
    """A folder of links to this venv's copies of the image's packages and what they need,
    less what the image lacks (every pin but typing-extensions, which torch needs: the image
    has one, and ours, newer, shadows it)."""
    lacks = set(pins()) - {"typing-extensions"}
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in IMAGE]
    dest.mkdir(parents=True)
    while todo:
        name = todo.pop()
        if name in seen or name in lacks:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional part this venv does not have either
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
        base = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            if not top.endswith(".pth") and not (dest / top).exists():
                (dest / top).symlink_to(base / top)
    return dest


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Python with no packages at all, the image's packages as a folder for PYTHONPATH)."""
    root = tmp_path_factory.mktemp("image")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root / "py")], check=True)
    return root / "py" / "bin" / "python", image_site(root / "site")


@pytest.fixture
def here_wheels(tmp_path: Path) -> Path:
    """The pins for this Python, and a Malleus wheel built now from the tree (offline)."""
    prepared(HERE_WHEELS, HERE_PY)
    folder = tmp_path / "wheels"
    folder.mkdir()
    for w in HERE_WHEELS.glob("*.whl"):
        if not w.name.startswith("malleus-"):
            shutil.copy(w, folder)
    shutil.copy(HERE_WHEELS / ".python-version", folder)
    script = ROOT / "scripts" / "gpu-wheels.sh"
    env = isolated_env(PYTHON=sys.executable, PATH=os.environ["PATH"])
    subprocess.run([str(script), str(folder), HERE_PY], env=env, check=True, capture_output=True)
    return folder


def test_install_without_pip(tmp_path: Path, bare: tuple[Path, Path], here_wheels: Path) -> None:
    """An image without pip: gpu_report.py unpacks the wheels instead, and they import."""
    python, image = bare
    site = tmp_path / "site"
    report = ROOT / "bench" / "gpu_report.py"
    env = isolated_env()
    out = subprocess.run(
        [str(python), str(report), "install", str(here_wheels), str(site)],
        env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert "no pip: unpacking" in out
    code = "import pydantic, jsonschema, celpy, re2, pendulum; import malleus.job, malleus.planner"
    subprocess.run(
        [str(python), "-c", code], env=env | {"PYTHONPATH": f"{site}:{image}"}, check=True
    )
    assert not list(site.glob("*.data"))


def test_gpu_script_from_wheels(tmp_path: Path, bare: tuple[Path, Path], here_wheels: Path) -> None:
    """As a bare lent machine runs it: an interpreter without Malleus (or pydantic, cel-python,
    jsonschema), the wheels installed with pip --no-index into a temporary site, every stage."""
    python, site = bare
    absent = "import importlib.util as u; assert u.find_spec('pydantic') is None"
    subprocess.run([str(python), "-c", absent], env=isolated_env(PYTHONPATH=str(site)), check=True)
    env = isolated_env(
        PYTHON=str(python), PYTHONPATH=str(site), MALLEUS_GPU_WHEELS=str(here_wheels)
    )
    run_gpu_script(tmp_path, **env, MALLEUS_GPU_SHARE_RANKS="1")
    check_figures(tmp_path, 1)
    assert "install: PASS" in (tmp_path / "summary.txt").read_text()
    assert "Successfully installed" in (tmp_path / "install.txt").read_text()
    imports = (tmp_path / "imports.txt").read_text()
    installed = re.search(r"ok malleus\.trainer\.engine\.trainer +from (\S+)", imports)
    assert installed and str(ROOT) not in installed.group(1), imports  # the wheel's, not the tree
    assert "the installed wheel matches the tree" in imports or "WARNING" in imports, imports


def test_gpu_script_stops_early_without_wheels(tmp_path: Path, bare: tuple[Path, Path]) -> None:
    """Nothing carried: the run stops at the install, saying what to do, in seconds."""
    python, site = bare
    env = isolated_env(PYTHON=str(python), PYTHONPATH=str(site))
    env |= {"MALLEUS_GPU_WHEELS": str(tmp_path / "none"), "MALLEUS_GPU_STAGES": "solo"}
    env |= {"OUT": str(tmp_path / "out")}
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh")], env=env, capture_output=True, text=True
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert done.returncode == 1, summary
    assert "install: FAIL" in summary and "stopped: the wheels did not install" in summary
    assert "scripts/gpu-wheels.sh" in done.stderr
    assert "solo" not in summary
