"""Bad data is refused before any trainer starts, by `malleus check`, `run` and `train` alike,
with the field to change and what is wrong (`malleus.job.data`); the operator, which cannot see
the trainers' volumes, judges the spec alone."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from malleus.cli import main
from malleus.errors import BadInput
from malleus.job import ResolvedJob
from malleus.job.data import SAMPLE_TOKENS
from malleus.runner.prepare import LocalRunOptions, prepare
from tests.trainer.data_cases import (
    corpus_tokens,
    data_job,
    make_tokenizer,
    save_dataset,
    write_tokens,
)


def job_file(tmp_path: Path, data: dict[str, Any] | None, **sizes: Any) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data_job(data, **sizes)))
    return str(path)


def file_faults(tmp_path: Path, data: dict[str, Any], **sizes: Any) -> dict[str, str]:
    """{field: message} of the job's data-file faults; the spec itself must be valid."""
    job = ResolvedJob.load(job_file(tmp_path, data, **sizes)).check()
    return {f.path: f.message for f in job.file_faults()}


def check(path: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        return main(["check", path]), err.getvalue()


def test_good_files_have_no_faults(tmp_path: Path) -> None:
    tokens = write_tokens(tmp_path / "t.bin", corpus_tokens(17))  # exactly one sample
    assert file_faults(tmp_path, {"format": "tokens", "path": str(tokens)}) == {}
    folder = save_dataset(tmp_path / "ds", [[1, 2, 3]] * 10)
    assert file_faults(tmp_path, {"format": "hf-dataset", "path": str(folder)}) == {}
    tok = make_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("hello")
    text = {"format": "text", "path": str(tmp_path / "a.txt"), "tokenizer": str(tok)}
    assert file_faults(tmp_path, text, vocab=300) == {}


def test_token_file_faults(tmp_path: Path) -> None:
    where = "spec.training.data.path"
    missing = file_faults(tmp_path, {"format": "tokens", "path": str(tmp_path / "no.bin")})
    assert missing == {where: f"{tmp_path / 'no.bin'}: no such file"}
    short = write_tokens(tmp_path / "s.bin", corpus_tokens(16))
    assert (
        "holds 16 tokens; one sample needs sequence + 1 = 17"
        in file_faults(tmp_path, {"format": "tokens", "path": str(short)})[where]
    )
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 101)
    assert (
        "not a whole number of uint16 token ids (2 bytes each): is the file uint32?"
        in (
            file_faults(tmp_path, {"format": "tokens", "path": str(odd)})[
                "spec.training.data.dtype"
            ]
        )
    )
    three = tmp_path / "three.bin"
    three.write_bytes(b"\0" * 102)  # 51 uint16 ids, but not whole uint32 ones
    assert "spec.training.data.dtype" in file_faults(
        tmp_path, {"format": "tokens", "path": str(three), "dtype": "uint32"}
    )


def test_ids_beyond_the_vocabulary_are_found_and_the_sample_stated(tmp_path: Path) -> None:
    small = np.zeros(100, np.int64)
    small[57] = 256
    path = write_tokens(tmp_path / "small.bin", small)
    message = file_faults(tmp_path, {"format": "tokens", "path": str(path)})[
        "spec.training.data.path"
    ]
    assert "token id 256 at token 57 is >= the model's vocabulary (256)" in message
    assert "every token checked" in message
    # A large file is checked on a sample that includes its first and last blocks.
    big = np.zeros(4 * SAMPLE_TOKENS, np.int64)
    big[-1] = 1000
    path = write_tokens(tmp_path / "big.bin", big)
    message = file_faults(tmp_path, {"format": "tokens", "path": str(path)})[
        "spec.training.data.path"
    ]
    assert f"token id 1000 at token {len(big) - 1:,}" in message
    assert f"found in a sample of {SAMPLE_TOKENS:,} of its {len(big):,} tokens" in message


def test_hf_dataset_faults(tmp_path: Path) -> None:
    folder = save_dataset(tmp_path / "ds", [[1, 2]] * 4, text=["a"] * 4)
    data = {"format": "hf-dataset", "path": str(folder)}
    assert file_faults(tmp_path, {**data, "column": "tokens"}) == {
        "spec.training.data.column": f"{folder} has no column 'tokens'; its columns: "
        "input_ids, text"
    }
    assert (
        "is string, expected lists of integer token ids"
        in (file_faults(tmp_path, {**data, "column": "text"})["spec.training.data.column"])
    )
    assert (
        "holds 8 tokens; one sample needs sequence + 1 = 17"
        in file_faults(tmp_path, data)["spec.training.data.path"]
    )
    big = save_dataset(tmp_path / "big", [[5] * 20, [1, 400]])
    assert (
        "token id 400 at token 21 is >= the model's vocabulary (256)"
        in file_faults(tmp_path, {"format": "hf-dataset", "path": str(big)})[
            "spec.training.data.path"
        ]
    )
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1]]})}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert (
        "holds a DatasetDict; point path at one of its splits (train)"
        in file_faults(tmp_path, {"format": "hf-dataset", "path": str(tmp_path / "dict")})[
            "spec.training.data.path"
        ]
    )
    assert (
        "not a folder written by datasets' save_to_disk"
        in file_faults(tmp_path, {"format": "hf-dataset", "path": str(tmp_path)})[
            "spec.training.data.path"
        ]
    )


def test_text_faults(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok", vocab=300)
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    text = {"format": "text", "path": str(tmp_path / "a.jsonl"), "tokenizer": str(tok)}
    assert file_faults(tmp_path, text) == {
        "spec.training.data.path": f'{tmp_path / "a.jsonl"} line 1 has no string field "text"',
        "spec.training.data.tokenizer": f"the tokenizer in {tok} has 300 token ids, more than "
        "the model's vocabulary (256)",
    }
    (tmp_path / "b.csv").write_text("x")
    assert file_faults(tmp_path, {**text, "path": str(tmp_path / "b.csv")}) == {
        "spec.training.data.path": f"{tmp_path / 'b.csv'} is neither .txt nor .jsonl",
        "spec.training.data.tokenizer": f"the tokenizer in {tok} has 300 token ids, more than "
        "the model's vocabulary (256)",
    }
    no_tok = {**text, "tokenizer": str(tmp_path)}
    assert file_faults(tmp_path, no_tok, vocab=300)["spec.training.data.tokenizer"] == (
        f"{tmp_path} holds no tokenizer.json"
    )


def test_check_run_and_train_refuse_bad_files_and_the_operator_does_not_look(
    tmp_path: Path,
) -> None:
    path = job_file(tmp_path, {"format": "tokens", "path": str(tmp_path / "gone.bin")})
    code, err = check(path)
    assert code == 2
    assert f"spec.training.data.path: {tmp_path / 'gone.bin'}: no such file" in err
    with pytest.raises(BadInput, match=r"gone\.bin: no such file"):
        prepare(LocalRunOptions(job=path, check_resources=False))
    from malleus.trainer import cli
    from malleus.trainer.run import inputs

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(BadInput, match=r"gone\.bin: no such file"):
        inputs.judge(parser.parse_args([path]))
    # What the operator does: resolve and judge the spec; no file is opened.
    assert ResolvedJob.load(path).check().initial_plan().generation == 1


def test_text_needs_a_tokenizer_and_tiny_corpus_needs_bytes(tmp_path: Path) -> None:
    code, err = check(job_file(tmp_path, {"format": "text", "path": "x.txt"}))
    assert code == 2 and "spec.training.data.tokenizer" in err and "is required" in err
    code, err = check(job_file(tmp_path, None, vocab=100))
    assert code == 2
    assert (
        "spec.training.dataset: tiny-corpus is byte-level and needs spec.model.vocab >= 256" in err
    )
