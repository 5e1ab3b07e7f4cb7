"""`malleus data prepare --tokenizer DIR INPUT... -o OUT.bin`: text to the tokens format, once."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from malleus.cli import main
from malleus.job.data import data_file_faults
from malleus.job.spec import DataSpec, TrainingSpec
from malleus.trainer.data import prepare as prepare_data
from malleus.trainer.data.prepare import Encoder, prepare
from tests.trainer.data_cases import CORPUS_PATH, make_tokenizer


def run(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["data", "prepare", *argv])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_prepare_writes_tokens_a_job_can_train_on(tmp_path: Path, tokenizer: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.jsonl").write_text(json.dumps({"text": "the miller"}) + "\n\n")
    (docs / "b.txt").write_text(CORPUS_PATH.read_text()[:3000])
    out = tmp_path / "train.bin"
    code, err = run("--tokenizer", str(tokenizer), str(docs), "-o", str(out))
    assert code == 0, err
    ids = np.fromfile(out, dtype="<u2")
    want = [
        t for chunk in Encoder(tokenizer).encode([docs / "a.jsonl", docs / "b.txt"]) for t in chunk
    ]
    assert ids.tolist() == want
    assert "malleus data prepare: " in err and " MB, " in err
    assert f"wrote {len(ids):,} uint16 tokens to {out}" in err
    training = TrainingSpec(
        global_batch_size=1,
        micro_batch_size=1,
        steps=1,
        learning_rate=1e-3,
        data=DataSpec(format="tokens", path=str(out)),
    )
    assert data_file_faults(training, vocab=300, sequence=64) == []


def test_progress_is_reported_on_long_inputs(
    tmp_path: Path, tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepare_data, "_PIECE_BYTES", 16 << 10)  # long: many pieces, batches
    monkeypatch.setattr(prepare_data, "_BATCH", 2)
    text = tmp_path / "long.txt"
    text.write_text(CORPUS_PATH.read_text()[:100_000] * 2)
    lines: list[str] = []
    tokens = prepare(
        [str(text)], str(tokenizer), str(tmp_path / "o.bin"), report=lines.append, every_s=0
    )
    progress = [line for line in lines if line.startswith("malleus data prepare: ")]
    assert len(progress) >= 5 and progress[-1].split(", ")[0].endswith(
        f"{text.stat().st_size / 1e6:,.1f}/{text.stat().st_size / 1e6:,.1f} MB"
    )
    assert (tmp_path / "o.bin").stat().st_size == 2 * tokens


def test_a_vocabulary_beyond_uint16_takes_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "big"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 zzz")
    out = tmp_path / "o.bin"
    code, err = run(
        "--tokenizer", str(folder), str(tmp_path / "a.txt"), "-o", str(out), "--dtype", "uint16"
    )
    assert code == 2
    assert "--dtype: uint16 holds ids below 65536; this tokenizer has 70,001: use uint32" in err
    assert run("--tokenizer", str(folder), str(tmp_path / "a.txt"), "-o", str(out))[0] == 0
    assert np.fromfile(out, dtype="<u4").tolist() == [1, 69_999, 70_000]


def test_bad_inputs_exit_2_and_leave_no_file(tmp_path: Path, tokenizer: Path) -> None:
    out = tmp_path / "o.bin"
    code, err = run("--tokenizer", str(tokenizer), str(tmp_path / "none.txt"), "-o", str(out))
    assert code == 2 and "none.txt: not a .txt / .jsonl file or a folder of them" in err
    (tmp_path / "a.txt").write_text("x")
    code, err = run("--tokenizer", str(tmp_path), str(tmp_path / "a.txt"), "-o", str(out))
    assert code == 2 and f"--tokenizer: {tmp_path} holds no tokenizer.json" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{oops\n")
    code, err = run("--tokenizer", str(tokenizer), str(bad), "-o", str(out))
    assert code == 2 and f"{bad} line 2 is not JSON" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "bad.jsonl"]


def test_the_command_line_loads_no_numpy_torch_or_tokenizers() -> None:
    """`malleus check` runs in the operator's image (no trainer extra): building the parser,
    `data prepare` included, imports none of them."""
    code = (
        "import sys, malleus.cli; malleus.cli._build_parser(); "
        "print(sorted(m for m in ('numpy', 'torch', 'tokenizers', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
