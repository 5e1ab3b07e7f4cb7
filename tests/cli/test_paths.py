"""Every path a job names is checked before anything starts, as a user mistypes it.

`spec.model.path` (a folder that does not exist, holds no config.json, or no weights) and the
data paths (`spec.training.data.path`, `.tokenizer`) are refused by `malleus check`, `run` and
`train` with exit 2, the field, what is wrong and what to do; in a pod by each trainer, whose
refusal becomes the job's `BadInput` condition. A job trains from random weights only when it
names no path. (`spec.checkpoint.path` is where the operator mounts the checkpoint volume in
every pod, so it exists by construction; `malleus run` and `train` do not read it.)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from malleus.cli import main
from malleus.job import FailurePolicy
from tests.job.tiny_llama import LLAMA, SEQUENCE, write_config
from tests.trainer.data_cases import data_job

MALLEUS = Path(sys.executable).with_name("malleus")
SIZES = {"layers": 2, "hidden": 64, "heads": 8, "kvHeads": 2, "ffn": 96, "vocab": 97}
"""The tiny Llama's sizes, stated beside the path as a cluster job states them."""


def model_folder(folder: Path) -> Path:
    """A Hugging Face folder as `malleus check` judges it: config.json and a safetensors file
    (its bytes are read by the trainers only)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, LLAMA)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def job_file(
    tmp_path: Path, *, path: str | None = None, data: dict[str, Any] | None = None
) -> Path:
    """A small job (`data_job`) with `spec.model.path` (sizes stated beside it) and/or data."""
    manifest = data_job(data, vocab=LLAMA["vocab_size"], sequence=SEQUENCE)
    if path is not None:
        manifest["spec"]["model"] = {"path": path, "sequence": SEQUENCE, **SIZES}
    if data is None:
        manifest["spec"]["training"]["dataset"] = "synthetic"
    tmp_path.mkdir(exist_ok=True)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    return job


def check(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", *argv])
    return code, out.getvalue(), err.getvalue()


def faults(job: Path) -> dict[str, str]:
    """{field: message} of `malleus check --json`'s refusal (exit 2)."""
    code, out, _ = check(str(job), "--json")
    assert code == 2, out
    return {f["path"]: f["message"] for f in json.loads(out)["faults"]}


# ---- spec.model.path --------------------------------------------------------------------------


def test_a_mistyped_model_path_is_refused_by_check_run_and_train(tmp_path: Path) -> None:
    model_folder(tmp_path / "own-model" / "llama")
    job = job_file(tmp_path, path="own-model/llamma")  # relative: read from the working directory
    assert check(str(job_file(tmp_path / "ok", path=str(tmp_path / "own-model/llama"))))[0] == 0
    extra = {"run": ["--workdir", "run-dir"], "train": ["--steps", "2", "--quiet"]}
    procs = {
        command: subprocess.Popen(
            [str(MALLEUS), command, str(job), *extra.get(command, [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for command in ("check", "run", "train")
    }
    said = {}
    for command, proc in procs.items():
        out, said[command] = proc.communicate(timeout=120)
        where = f"malleus {command}: {said[command]}"
        assert proc.returncode == 2 and out == "" and "Traceback" not in where, where
        assert (
            f"  - spec.model.path: own-model/llamma (under {tmp_path}): no such folder; correct "
            "the path" in where
        ), where
        assert "or leave spec.model.path out (stating the sizes) to train from random" in where
    assert "--no-file-check" in said["check"]  # a path that exists only in the cluster's pods
    assert said["run"] == said["train"] == said["check"].rsplit("\n", 2)[0] + "\n"
    assert not (tmp_path / "run-dir").exists()  # refused before anything started


def test_check_names_the_way_out_for_a_path_that_exists_only_in_the_cluster(
    tmp_path: Path,
) -> None:
    job = job_file(tmp_path, path="/models/my-llama")
    code, out, err = check(str(job))
    assert (code, out) == (2, "")
    assert "  - spec.model.path: /models/my-llama: no such folder" in err
    assert err.splitlines()[-1].startswith("if these paths exist only on the cluster's volumes, ")
    assert "`malleus check --no-file-check`" in err
    code, out, err = check(str(job), "--no-file-check")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "job data-test: valid"
    assert "files: not looked for here (--no-file-check)" in out
    code, out, _ = check(str(job), "--no-file-check", "--json")
    assert code == 0 and json.loads(out)["files_checked"] is False


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("config.json named", "{folder}/config.json is a file, not a model folder"),
        ("parent folder named", "{parent} holds no config.json: not a Hugging Face model folder"),
        ("no weights", "{folder} holds config.json but no weights (*.safetensors)"),
        ("a shard missing", "names model-00002-of-00002.safetensors, missing from {folder}"),
        ("pickled weights", "{folder} holds *.bin weights and no *.safetensors"),
    ],
)
def test_a_model_path_that_is_not_a_model_folder_is_refused(
    tmp_path: Path, mistake: str, message: str
) -> None:
    parent = tmp_path / "own-model"
    folder = model_folder(parent / "llama")
    path = folder
    if mistake == "config.json named":
        path = folder / "config.json"
    elif mistake == "parent folder named":
        path = parent
    elif mistake == "no weights":
        (folder / "model.safetensors").unlink()
    elif mistake == "a shard missing":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        names = {"embed_tokens": "model-00001-of-00002.safetensors"}
        names["lm_head"] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    elif mistake == "pickled weights":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    found = faults(job_file(tmp_path, path=str(path)))
    assert list(found) == ["spec.model.path"]
    assert message.format(folder=folder, parent=parent) in found["spec.model.path"]
    way_out = {
        "config.json named": f"name its folder, {folder}",
        "parent folder named": f"did you mean {folder}?",
        "no weights": "to train from random weights",
        "a shard missing": "copy the whole folder save_pretrained wrote",
        "pickled weights": "safe_serialization=True",
    }
    assert way_out[mistake] in found["spec.model.path"]


def test_a_folder_without_weights_never_starts_from_random_ones(tmp_path: Path) -> None:
    """The trainer's own word, whoever calls it: random pieces only for a job without a path."""
    from malleus.errors import BadInput
    from malleus.job import ResolvedJob
    from malleus.trainer.model.hf import WeightFiles

    folder = write_config(tmp_path, LLAMA)  # config.json alone
    job = ResolvedJob.load(job_file(tmp_path, path=str(folder)))
    with pytest.raises(BadInput, match=r"spec\.model\.path: .* but no weights"):
        WeightFiles.of(job)
    assert WeightFiles.of(ResolvedJob.load(job_file(tmp_path / "none"))) is None


def test_each_trainer_in_a_pod_refuses_a_mistyped_path_and_tells_the_operator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from malleus.operator import failures
    from malleus.trainer import cli

    log = tmp_path / "termination-log"  # the kubelet creates it in every container
    log.write_text("")
    monkeypatch.setattr("malleus.trainer.world.errors.TERMINATION_LOG", log)
    # a pod's process owns its streams and signals; this one shares pytest's: leave them be
    monkeypatch.setattr("malleus.trainer.launch.output.whole_lines", lambda: None)
    monkeypatch.setattr("malleus.trainer.launch.distributed.quiet_signals", lambda: None)
    job = job_file(tmp_path, path="/models/llamma")
    assert cli.worker_main([str(job), "--plan", str(tmp_path / "unused.json")]) == 2
    err = capsys.readouterr().err
    assert "  - spec.model.path: /models/llamma: no such folder" in err
    assert err.splitlines()[-1].startswith("in a pod, paths are read where spec.podTemplate")
    message = log.read_text()
    assert message.startswith("BadInput: invalid MalleusJob in ")
    # What the operator sees: torchrun's exit 1 and this message -> the job's Failed condition.
    term = {"exitCode": 1, "reason": "Error", "message": message}
    pod = {
        "metadata": {"name": "demo-node-0", "uid": "u0"},
        "status": {"containerStatuses": [{"name": "trainer", "state": {"terminated": term}}]},
    }
    refused = failures.pod_failure(pod, "demo")
    assert refused is not None and refused.reason == "BadInput"
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    records, _ = failures.record_failures(None, [refused], FailurePolicy(), at)
    reason, why = failures.terminal_reason(records, 1)  # type: ignore[misc]
    assert reason == "BadInput" and "spec.model.path: /models/llamma: no such folder" in why


# ---- the data paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (
            {"format": "tokens", "path": "train.bni"},
            "path",
            "train.bni (under {cwd}): no such file",
        ),
        (
            {"format": "hf-dataset", "path": "{tmp}/ds-typo"},
            "path",
            "{tmp}/ds-typo: no such folder",
        ),
        (
            {"format": "text", "path": "{tmp}/corpus.txtt", "tokenizer": "{tmp}/tok"},
            "path",
            "{tmp}/corpus.txtt: no such file or folder",
        ),
        (
            {"format": "text", "path": "{tmp}/corpus.txt", "tokenizer": "{tmp}/tokk"},
            "tokenizer",
            "{tmp}/tokk: no such folder",
        ),
    ],
    ids=["tokens path", "hf-dataset path", "text path", "tokenizer"],
)
def test_a_mistyped_data_path_is_refused_naming_its_field(
    tmp_path: Path, data: dict[str, str], field: str, message: str
) -> None:
    (tmp_path / "corpus.txt").write_text("hello")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    data = {k: v.format(tmp=tmp_path) for k, v in data.items()}
    found = faults(job_file(tmp_path, data=data))
    assert list(found) == [f"spec.training.data.{field}"]
    assert found[f"spec.training.data.{field}"] == message.format(tmp=tmp_path, cwd=Path.cwd())
