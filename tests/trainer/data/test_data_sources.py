"""The user's data as samples: tokens, hf-dataset and text read into the same windows, in an
order that is a pure function of (seed, sample index), every window once per epoch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from malleus.job.spec import DataSpec
from malleus.trainer.data.prepare import Encoder, prepare
from malleus.trainer.data.samples import (
    TokenStream,
    WindowSource,
    make_source,
    micro_batch,
    open_stream,
)
from tests.trainer.data_cases import (
    EOS,
    corpus_tokens,
    make_tokenizer,
    save_dataset,
    write_tokens,
)

SEQ = 8


def windows_of(source: WindowSource, count: int) -> list[int]:
    return [source.window(i) for i in range(count)]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_memory_mapped_and_cut_into_windows(tmp_path: Path, dtype: str) -> None:
    ids = np.arange(70_000, 70_000 + 81) if dtype == "uint32" else np.arange(81)
    path = write_tokens(tmp_path / "train.bin", ids, dtype)
    stream = open_stream(DataSpec(format="tokens", path=str(path), dtype=dtype))
    assert isinstance(stream.segments[0], np.memmap)  # mapped, never read whole
    source = WindowSource(stream, SEQ, vocab=100_000, seed=3)
    assert source.windows == 10  # (81 - 1) // 8: windows start every 8 tokens, hold 9
    for index in range(25):
        w = source.window(index)
        assert source.sample(index).tolist() == ids[w * SEQ : w * SEQ + SEQ + 1].tolist()
    # Each epoch visits every window once, in an order of its own.
    epochs = [windows_of(source, 30)[e * 10 : (e + 1) * 10] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_order_is_a_function_of_seed_and_index_alone(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.bin", corpus_tokens(5000))
    data = DataSpec(format="tokens", path=str(path))
    a = make_source("tiny-corpus", SEQ, 256, 7, data)
    b = make_source("tiny-corpus", SEQ, 256, 7, data)
    # Micro-batch 3 of step 5 read alone equals the same rows read after the whole run so far:
    # nothing depends on what was read before (a resumed job) or on who asks (any plan).
    late = micro_batch(b, 5, 3, 8, 2)
    for step in range(6):
        for micro in range(4):
            micro_batch(a, step, micro, 8, 2)
    assert all(torch.equal(x, y) for x, y in zip(micro_batch(a, 5, 3, 8, 2), late, strict=True))
    other = make_source("tiny-corpus", SEQ, 256, 8, data)
    assert windows_of(other, 50) != windows_of(a, 50)
    # Large streams too: the permutation stays a bijection of the windows.
    big = WindowSource(TokenStream([np.zeros(SEQ * 1000 + 1, np.int64)], "big"), SEQ, 2, 1)
    assert sorted(windows_of(big, 1000)) == list(range(1000))


def test_a_file_of_exactly_one_sample_is_valid(tmp_path: Path) -> None:
    ids = corpus_tokens(SEQ + 1)
    data = DataSpec(format="tokens", path=str(write_tokens(tmp_path / "one.bin", ids)))
    source = make_source("tiny-corpus", SEQ, 256, 1, data)
    assert all(source.sample(i).tolist() == ids.tolist() for i in range(5))
    short = DataSpec(format="tokens", path=str(write_tokens(tmp_path / "short.bin", ids[:-1])))
    with pytest.raises(ValueError, match=r"holds 8 tokens; one sample needs sequence \+ 1 = 9"):
        make_source("tiny-corpus", SEQ, 256, 1, short)


def test_an_id_outside_the_vocabulary_is_refused_when_read(tmp_path: Path) -> None:
    ids = np.zeros(SEQ + 1, np.int64)
    ids[4] = 300
    data = DataSpec(format="tokens", path=str(write_tokens(tmp_path / "bad.bin", ids)))
    with pytest.raises(ValueError, match=r"token id 300 at token 4 is >= the model's vocabulary"):
        make_source("tiny-corpus", SEQ, 256, 1, data).sample(0)


def test_hf_dataset_is_packed_in_row_order_across_shards(tmp_path: Path) -> None:
    rows = [list(range(i * 10, i * 10 + 3 + i % 5)) for i in range(40)]
    folder = save_dataset(tmp_path / "ds", rows, shards=3, text=[str(i) for i in range(40)])
    assert len(list(folder.glob("*.arrow"))) == 3
    stream = open_stream(DataSpec(format="hf-dataset", path=str(folder)))
    packed = [t for row in rows for t in row]
    assert len(stream) == len(packed) and len(stream.segments) >= 3
    assert stream.read(0, len(packed)).tolist() == packed  # reads that span the shards
    source = WindowSource(stream, SEQ, vocab=1000, seed=2)
    for index in range(source.windows + 3):
        w = source.window(index)
        assert source.sample(index).tolist() == packed[w * SEQ : w * SEQ + SEQ + 1]


def test_text_is_tokenized_per_document_with_end_of_text(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path / "tok")
    docs = ["the miller walked to the river.", "a clever fox ran home", "the end"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:2]))
    (tmp_path / "b.txt").write_text(docs[2])
    encoder = Encoder(tokenizer)
    eos = encoder.tokenizer.token_to_id(EOS)
    want: list[int] = []
    for doc in docs:
        want += [*encoder.tokenizer.encode(doc, add_special_tokens=False).ids, eos]
    spec = DataSpec(format="text", path=str(tmp_path), tokenizer=str(tokenizer))
    stream = open_stream(spec)
    assert stream.read(0, len(stream)).tolist() == want
    # `malleus data prepare` writes the same ids once, as the tokens format.
    out = tmp_path / "out.bin"
    assert prepare([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")], str(tokenizer), str(out))
    assert np.fromfile(out, dtype="<u2").tolist() == want
    tokens = WindowSource(open_stream(DataSpec(format="tokens", path=str(out))), 4, 300, 5)
    text = WindowSource(stream, 4, 300, 5)
    assert all(torch.equal(tokens.sample(i), text.sample(i)) for i in range(20))
