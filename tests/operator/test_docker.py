"""The Dockerfile, without a Docker engine: its structure, and its install steps run for real.

Every install step of the images is ``scripts/docker-install.sh``; here it builds the wheel and
installs it into fresh virtual environments (offline: the dependencies come from the test
environment through a .pth file), then runs each image's entrypoint with ``--help``.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from malleus.operator import workers

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "docker-install.sh"


def _stages() -> dict[str, list[str]]:
    """Dockerfile instructions (continuations joined) by stage name."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current = "<global>"
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(1)
        stages.setdefault(current, []).append(line)
    return stages


def _user(stage: list[str]) -> str:
    users = [line.split()[1] for line in stage if line.startswith("USER ")]
    assert users, "stage has no USER"
    return users[-1]


def test_two_images_both_non_root() -> None:
    stages = _stages()
    assert {"build", "operator", "trainer"} <= set(stages)
    for name in ("operator", "trainer"):
        uid = _user(stages[name]).split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{name} runs as {uid}"
    # the uids the manifests expect
    values = yaml.safe_load((ROOT / "helm/malleus-operator/values.yaml").read_text())
    assert _user(stages["operator"]) == f"{values['podSecurityContext']['runAsUser']}:" + str(
        values["podSecurityContext"]["runAsGroup"]
    )
    assert _user(stages["trainer"]) == f"{workers.RUN_AS_USER}:{workers.RUN_AS_USER}"


def test_operator_image_has_no_torch_and_the_charts_entrypoint() -> None:
    op = _stages()["operator"]
    assert not any("torch" in line.lower() for line in op)
    (entry,) = [line for line in op if line.startswith("ENTRYPOINT")]
    assert entry == 'ENTRYPOINT ["python", "-m", "malleus.operator"]'
    chart = (ROOT / "helm/malleus-operator/templates/deployment.yaml").read_text()
    assert 'command: ["python", "-m", "malleus.operator"]' in chart


def test_the_images_docs_build_the_dockerfiles_targets_under_the_charts_names() -> None:
    """docs/images.md's commands and CI workflow name real stages and the images the chart and
    the examples expect (the defaults are placeholders; the names are not)."""
    stages = _stages()
    text = (ROOT / "docs" / "images.md").read_text()
    for target in re.findall(r"--target (\S+)", text):
        assert target in stages, f"docs/images.md builds --target {target}: no such stage"
    (workflow,) = re.findall(r"```yaml\n(# \.github/workflows/.*?)```", text, re.DOTALL)
    ci = yaml.safe_load(workflow)
    (job,) = ci["jobs"].values()
    matrix = job["strategy"]["matrix"]["include"]
    assert {m["target"] for m in matrix} == {"operator", "trainer"}
    (step,) = [s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push")]
    assert step["with"]["target"] == "${{ matrix.target }}" and step["with"]["push"] is True
    values = yaml.safe_load((ROOT / "helm/malleus-operator/values.yaml").read_text())
    example = yaml.safe_load((ROOT / "examples/tiny-cpu.yaml").read_text())
    names = {m["target"]: m["image"] for m in matrix}
    assert values["image"]["repository"].rsplit("/", 1)[1] == names["operator"]
    assert example["spec"]["image"].rsplit("/", 1)[1].split(":")[0] == names["trainer"]
    assert any("whl/cpu" in m.get("args", "") for m in matrix)  # the CPU trainer too


def test_install_steps_are_the_script_and_copies_exist() -> None:
    for name, lines in _stages().items():
        for line in lines:
            if line.startswith("RUN") and name in ("operator", "trainer"):
                assert "malleus-docker-install" in line or "useradd" in line, line
            if line.startswith("COPY") and "--from=" not in line:
                *sources, _ = line.split()[1:]
                for src in sources:
                    assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    env = {**os.environ, "PYTHON": sys.executable, "MALLEUS_WHEEL_ARGS": "--no-build-isolation"}
    subprocess.run(
        [str(SCRIPT), "wheel", str(out)], env=env, check=True, capture_output=True, timeout=300
    )
    assert list(out.glob("malleus-*.whl"))
    return out


def _closure(extra: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``malleus[extra]`` requires, transitively (malleus aside)."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [("malleus", (extra,))]
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in extras_seen and set(extras) <= extras_seen[key]:
            continue
        extras_seen.setdefault(key, set()).update(extras)
        dist = importlib.metadata.distribution(name)
        if key != "malleus":
            found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in (extras or ("",))]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, tuple(req.extras)))
    return list(found.values())


def _deps_dir(extra: str, path: Path) -> Path:
    """A folder holding (symlinks to) exactly the installed dependencies of malleus[extra]:
    a dependency missing from pyproject's extra is then missing in the image test too."""
    path.mkdir()
    for dist in _closure(extra):
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {".."}:
            if (base / top).exists() and not (path / top).exists():
                (path / top).symlink_to(base / top)
    return path


def _venv(path: Path, deps: Path) -> Path:
    """A fresh venv (no pip of its own: this environment's pip installs into it with
    ``--python``) whose only other packages are ``deps``, installed offline."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "deps-from-tests.pth").write_text(f"{deps}\n")
    return python


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_install_script_builds_a_working_image(image: str, wheel_dir: Path, tmp_path: Path) -> None:
    """The image's install step into a venv that has only the extra's dependencies, then its
    entrypoint's --help and import checks (the operator's: no torch imported)."""
    if image == "trainer":
        pytest.importorskip("torch")
    python = _venv(tmp_path / "venv", _deps_dir(image, tmp_path / "deps"))
    env = {
        **os.environ,
        "PYTHON": str(python),
        "MALLEUS_PIP": f"{sys.executable} -m pip --python {python}",
        "MALLEUS_PIP_ARGS": "--no-deps --no-index",
        "PYTHONNOUSERSITE": "1",
    }
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [str(SCRIPT), image, str(wheel_dir)],
        env=env,
        cwd=tmp_path,  # not the repository: `malleus` must come from the installed wheel
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"docker-install: {image} OK" in result.stdout
    module = "malleus.operator.handlers" if image == "operator" else "malleus.trainer.cli"
    where = subprocess.run(
        [str(python), "-c", f"import {module} as m; print(m.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(tmp_path / "venv") in where, f"malleus came from {where}"


def test_the_trainer_image_carries_the_rdma_libraries_nccl_loads() -> None:
    """NCCL over InfiniBand or RoCE dlopens libibverbs.so.1 (rdma-core): the trainer image
    installs it as root, before it drops to its user; the operator image has no use for it."""
    stages = _stages()
    trainer = stages["trainer"]
    rdma = [i for i, line in enumerate(trainer) if line == "RUN malleus-docker-install rdma"]
    user = [i for i, line in enumerate(trainer) if line.startswith("USER ")]
    assert rdma and user and rdma[0] < user[0], trainer
    assert not any("rdma" in line for line in stages["operator"])


@pytest.mark.skipif(
    not (shutil.which("apt-get") and shutil.which("dpkg-deb")), reason="needs Debian's apt-get"
)
def test_the_rdma_packages_exist_and_give_a_loadable_libibverbs(tmp_path: Path) -> None:
    """The install step's packages, fetched from Debian (the images' base) and unpacked without
    root: libibverbs.so.1 loads, as NCCL loads it."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(
        [str(SCRIPT), "rdma", str(tmp_path / "root")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "docker-install: rdma OK" in result.stdout
    assert (tmp_path / "root/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists()
