"""Inputs (issue 25, item 6, first half): files that name other files stay in their folder;
special files are checkpoint errors; dependency floors sit above the CVEs named.

Each test writes the malicious file in tmp_path and runs the real loader:
- a Hugging Face index whose `weight_map` names `../` and absolute paths (which exist, so a
  refusal is not just "missing"): BadInput naming the index and the entry, from both
  `malleus check`'s judge (`folder_faults`) and the trainer's reader (`WeightFiles`);
- a saved dataset whose `state.json` lists another dataset's arrow file by `../` and by an
  absolute path: the reader the trainers use (`arrow_chunks`) refuses, and the job's file
  check says so, naming state.json and the entry;
- a checkpoint `latest` linked to `/dev/zero` (a MemoryError before), a named pipe (would block),
  an oversize pointer, a manifest linked to `/dev/zero`, a payload file that is a pipe: each
  a CheckpointError naming the file, raised before anything is read;
- pyproject's floors: torch >= 2.6 (CVE-2025-32434, `weights_only` bypass) and pyarrow >=
  14.0.1 (CVE-2023-47248), and the installed versions meet them.
"""

from __future__ import annotations

import json
import os
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from safetensors.torch import save_file

from malleus.errors import BadInput
from malleus.job import ResolvedJob
from malleus.job.data import arrow_chunks
from malleus.job.hf import INDEX, folder_faults
from malleus.trainer.checkpoint import directory
from malleus.trainer.checkpoint.files import CheckpointError, load_file
from malleus.trainer.model.hf import WeightFiles
from tests.trainer.data_cases import data_job, save_dataset

REPO = Path(__file__).resolve().parents[2]


# ---- Hugging Face index -------------------------------------------------------------------
def _model_folder(tmp_path: Path, weight_map: dict[str, str]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": torch.zeros(2)}, str(folder / "model-00001.safetensors"))
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_an_hf_index_cannot_send_the_reader_outside_the_model_folder(tmp_path: Path) -> None:
    save_file({"secret": torch.ones(2)}, str(tmp_path / "other-job.safetensors"))  # exists
    weight_map = {
        "model.embed_tokens.weight": "model-00001.safetensors",
        "model.norm.weight": "../other-job.safetensors",
        "lm_head.weight": "/etc/passwd",
    }
    folder = _model_folder(tmp_path, weight_map)
    index = folder / INDEX

    faults = [f.message for f in folder_faults(folder)]  # what `malleus check` says
    assert any(
        str(index) in m and "'../other-job.safetensors'" in m and "outside" in m for m in faults
    )
    assert any("'/etc/passwd'" in m and "outside" in m for m in faults)

    with pytest.raises(BadInput) as caught:  # what a trainer does
        WeightFiles(folder)
    text = str(caught.value)
    assert str(index) in text
    assert "weight_map['model.norm.weight'] names '../other-job.safetensors'" in text
    assert "weight_map['lm_head.weight'] names '/etc/passwd'" in text

    fine = _model_folder(tmp_path / "ok", {"w": "model-00001.safetensors"})
    assert WeightFiles(fine).where == {"w": fine / "model-00001.safetensors"}


# ---- a saved dataset's state.json ---------------------------------------------------------
@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_dataset_state_json_cannot_list_files_outside_its_folder(
    tmp_path: Path, how: str
) -> None:
    other = save_dataset(tmp_path / "other", [[7] * 40])  # another job's data, readable
    mine = save_dataset(tmp_path / "mine", [[1] * 40])
    [arrow] = sorted(other.glob("*.arrow"))
    name = f"../other/{arrow.name}" if how == "relative" else str(arrow)
    state = mine / "state.json"
    data = json.loads(state.read_text())
    data["_data_files"] = [{"filename": name}]
    state.write_text(json.dumps(data))

    with pytest.raises(ValueError, match="outside") as caught:  # the trainers' reader
        arrow_chunks(mine, "input_ids")
    assert str(state) in str(caught.value) and repr(name) in str(caught.value)

    job = ResolvedJob.load(data_job({"format": "hf-dataset", "path": str(mine)})).check()
    faults = {f.path: f.message for f in job.file_faults()}  # `malleus check` / run / train
    assert "outside" in faults["spec.training.data.path"]
    assert repr(name) in faults["spec.training.data.path"]


def test_a_malformed_state_json_is_a_fault_not_a_crash(tmp_path: Path) -> None:
    mine = save_dataset(tmp_path / "mine", [[1] * 40])
    (mine / "state.json").write_text(json.dumps({"_data_files": "x"}))
    with pytest.raises(ValueError, match="no _data_files list"):
        arrow_chunks(mine, "input_ids")


# ---- special files in a checkpoint directory ----------------------------------------------
def test_latest_linked_to_dev_zero_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "latest").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"latest is a character device, not a regular"):
        directory.latest(tmp_path)


def test_latest_as_a_named_pipe_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "latest")  # no writer: opening or reading it would block
    with pytest.raises(CheckpointError, match="latest is a named pipe"):
        directory.latest(tmp_path)


def test_an_oversize_latest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step-00000001" + " " * 10_000)
    with pytest.raises(CheckpointError, match="more than 4096"):
        directory.latest(tmp_path)


def test_a_manifest_linked_to_dev_zero_is_a_checkpoint_error(tmp_path: Path) -> None:
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "manifest.json").symlink_to("/dev/zero")
    (tmp_path / "latest").write_text(step.name)
    with pytest.raises(CheckpointError):  # `latest` finds no manifest file there
        directory.latest(tmp_path)
    with pytest.raises(CheckpointError, match=r"manifest\.json is a character device"):
        directory.read_manifest(step)


def test_a_payload_that_is_a_pipe_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "rank-00000.pt")
    manifest = {"step": 1, "files": {"rank-00000.pt": {"sha256": "0" * 64, "bytes": 0}}}
    with pytest.raises(CheckpointError, match=r"rank-00000\.pt is a named pipe"):
        load_file(tmp_path, "rank-00000.pt", manifest)


# ---- dependency floors ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("package", "fixed", "cve"),
    [("torch", "2.6", "CVE-2025-32434"), ("pyarrow", "14.0.1", "CVE-2023-47248")],
)
def test_dependency_floors_are_above_the_cves(package: str, fixed: str, cve: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    listed = [
        Requirement(r)
        for group in [project.get("dependencies", []), *project["optional-dependencies"].values()]
        for r in group
        if Requirement(r).name == package
    ]
    assert listed, f"{package} is not a dependency"
    for req in listed:
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert floors and min(floors) >= Version(fixed), f"{req}: {cve} is fixed in {fixed}"
        assert req.specifier.contains(Version(version(package)).base_version)
