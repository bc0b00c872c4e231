"""The byte-level corpus (helpers/text.py, introduced in notebooks/09-memory.ipynb): refusals that name where the
loader looked and the fix, the stdlib corpus, splits, windows and the byte codec."""

import sys

import pytest
import torch

from helpers import text


def test_a_missing_file_is_refused_naming_where_it_looked_and_the_fix(tmp_path):
    missing = tmp_path / "no-such-corpus.txt"
    with pytest.raises(text.CorpusMissing) as e:
        text.load_corpus(missing)
    assert str(missing) in str(e.value) and "Fix:" in str(e.value)


def test_a_missing_file_named_by_the_environment_says_so(tmp_path, monkeypatch):
    missing = tmp_path / "gone.txt"
    monkeypatch.setenv("COURSE_CORPUS", str(missing))
    with pytest.raises(text.CorpusMissing) as e:
        text.load_corpus()
    assert str(missing) in str(e.value) and "COURSE_CORPUS" in str(e.value) and "Fix:" in str(e.value)


def test_an_empty_file_is_refused_naming_where_it_looked_and_the_fix(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(text.CorpusMissing) as e:
        text.load_corpus(empty)
    assert str(empty) in str(e.value) and "empty" in str(e.value) and "Fix:" in str(e.value)


def test_a_python_without_pydoc_data_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delenv("COURSE_CORPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pydoc_data", None)  # what an import of a missing package meets
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)
    with pytest.raises(text.CorpusMissing) as e:
        text.load_corpus()
    assert "pydoc_data" in str(e.value) and sys.prefix in str(e.value) and "COURSE_CORPUS" in str(e.value)


def test_the_default_corpus_is_python_s_reference_topics_the_same_bytes_each_time(monkeypatch):
    monkeypatch.delenv("COURSE_CORPUS", raising=False)
    (data, where), (again, _) = text.load_corpus(), text.load_corpus()
    assert data == again and len(data) > 200_000 and "pydoc_data.topics" in where
    info = text.corpus_info(data, where)
    assert f"{len(data):,} bytes" in info and "sha256" in info


def test_a_file_corpus_is_read_as_is(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes("héllo\n".encode())
    assert text.load_corpus(path) == ("héllo\n".encode(), str(path))


def test_byte_splits_hold_out_the_end():
    data = bytes(range(256)) * 10
    train, val = text.byte_splits(data, held_out=0.25)
    assert len(train) + len(val) == len(data) and len(val) == len(data) // 4
    assert train.dtype == val.dtype == torch.int64
    assert bytes(train.tolist()) + bytes(val.tolist()) == data
    for bad in (0, 1, -0.1):
        with pytest.raises(ValueError):
            text.byte_splits(data, held_out=bad)


def test_random_windows_are_shifted_pairs_and_seeded():
    tokens = torch.arange(1000)
    x, y = text.random_windows(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(y, x + 1)
    x2, _ = text.random_windows(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError):
        text.random_windows(torch.arange(10), 1, 9)


def test_encode_and_decode_round_trip():
    s = "def f(x):\n    return x  # ünïcodé"
    assert text.VOCAB_SIZE == 256
    t = text.encode(s)
    assert t.dtype == torch.long and int(t.max()) < 256
    assert text.decode(t) == s
    assert text.decode(t[:-1]).endswith("\ufffd")  # a cut inside a UTF-8 character
