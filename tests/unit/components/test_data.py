"""Data: real text through datasets, tokenizers, packing, disjoint resumable shards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ray_diloco.components.data import ShardReader, load_corpus, num_train_windows, val_windows
from ray_diloco.config import DataConfig
from ray_diloco.errors import DataError


def test_char_corpus_split_and_round_trip(corpus, small_text):
    text = small_text.read_text()
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert len(corpus.val) == round(0.1 * len(text))
    assert corpus.tokenizer.decode(corpus.val[:200].tolist()) == text[len(corpus.train):len(corpus.train) + 200]
    assert corpus.vocab_size == len(set(text))


def test_bpe_tokenizer_trains_and_is_saved(small_text, tmp_path):
    c = load_corpus(DataConfig(path=str(small_text), tokenizer="bpe", bpe_vocab_size=300, seq_len=16), tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert c.vocab_size == 300 and len(c.train) < 0.8 * 60000  # merges compress the text
    assert c.tokenizer.decode(c.train[:50].tolist()) == small_text.read_text()[: len(c.tokenizer.decode(c.train[:50].tolist()))]


def test_jsonl_documents_with_text_field(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"body": f"document number {i} " * 20}) + "\n" for i in range(50)))
    c = load_corpus(DataConfig(path=str(f), text_field="body", seq_len=8))
    assert len(c.train) > 0 and len(c.val) > 0
    with pytest.raises(DataError, match="text_field"):
        load_corpus(DataConfig(path=str(f), text_field="text", seq_len=8))


def test_missing_or_tiny_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_corpus(DataConfig(path=str(tmp_path / "nope.txt")))
    small = tmp_path / "small.txt"
    small.write_text("abc")
    with pytest.raises(DataError, match="too small"):
        load_corpus(DataConfig(path=str(small), seq_len=64))


def test_shards_are_disjoint_within_an_epoch(corpus):
    """Every (replica, rank) shard reads different windows; together they cover the epoch once."""
    M, W, T = 3, 2, 16
    readers = [ShardReader(corpus.train, T, m * W + r, M * W, seed=7) for m in range(M) for r in range(W)]
    per = readers[0].per_shard
    seen = np.concatenate([rd.next_indices(per) for rd in readers])
    assert (seen[:, 0] == 0).all()
    assert len(np.unique(seen[:, 1])) == len(seen) == per * M * W
    assert len(seen) > num_train_windows(len(corpus.train), T) - M * W
    # the next read rolls into epoch 1 with a new permutation, still disjoint across shards
    nxt = np.concatenate([rd.next_indices(per) for rd in readers])
    assert (nxt[:, 0] == 1).all() and len(np.unique(nxt[:, 1])) == len(nxt)
    assert not np.array_equal(nxt[:per, 1], seen[:per, 1])


def test_reader_position_resumes_exactly(corpus):
    a = ShardReader(corpus.train, 16, 1, 4, seed=3)
    a.next_batch(5)
    state = a.state()
    expected = [a.next_batch(5) for _ in range(300)]  # crosses into later epochs
    b = ShardReader(corpus.train, 16, 1, 4, seed=3)
    b.load_state(state)
    for x, y, idx in expected:
        x2, y2, idx2 = b.next_batch(5)
        assert np.array_equal(idx, idx2) and (x == x2).all() and (y == y2).all()
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are inputs shifted by one token


def test_validation_windows_cover_the_split(corpus):
    n = val_windows(corpus.val, 16)
    assert n * 16 + 1 <= len(corpus.val) < (n + 1) * 16 + 1


def test_hugging_face_tokenizer_by_local_path(corpus, small_text, tmp_path):
    corpus.tokenizer.save_pretrained(str(tmp_path / "tok"))
    c = load_corpus(DataConfig(path=str(small_text), tokenizer=str(tmp_path / "tok"), seq_len=16))
    assert np.array_equal(c.train, corpus.train) and c.vocab_size == corpus.vocab_size
    with pytest.raises(DataError, match="data.tokenizer"):
        load_corpus(DataConfig(path=str(small_text), tokenizer=str(tmp_path / "missing-tok")))


def test_failed_checkpoint_write_leaves_older_checkpoints_intact(tmp_path):
    import threading

    from ray_diloco.components.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
    from ray_diloco.errors import CheckpointError

    good = {"format": 1, "outer_step": 1, "config": {}, "counters": {}, "outer": None, "workers": {},
            "corpus_fingerprint": "x"}
    save_checkpoint(tmp_path, 1, good, keep=3)
    with pytest.raises(CheckpointError, match="cannot be written"):
        save_checkpoint(tmp_path, 2, {**good, "outer_step": 2, "lock": threading.Lock()}, keep=3)  # unpicklable
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]  # no temporary left
    assert load_checkpoint(list_checkpoints(tmp_path)[0][1])["outer_step"] == 1


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_loading_a_checkpoint_never_runs_code_from_it(tmp_path):
    import torch

    from ray_diloco.components.checkpoint import load_checkpoint
    from ray_diloco.errors import CheckpointError

    marker = tmp_path / "PWNED"
    ck = tmp_path / "step_000001"
    ck.mkdir()
    torch.save({"outer_step": 1, "config": {}, "payload": _Evil(marker)}, ck / "state.pt")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_checkpoint(ck)
    assert not marker.exists()


def test_run_directory_lock_is_exclusive(tmp_path):
    from ray_diloco.components.checkpoint import lock_run_dir
    from ray_diloco.errors import CheckpointError

    held = lock_run_dir(tmp_path)
    import subprocess
    import sys

    code = ("from ray_diloco.components.checkpoint import lock_run_dir\n"
            f"lock_run_dir({str(tmp_path)!r})")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert other.returncode != 0 and "in use by another" in other.stderr
    held.close()
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    with pytest.raises(CheckpointError):  # a second lock in this process conflicts too (flock per open file)
        second = lock_run_dir(tmp_path)
        third = lock_run_dir(tmp_path)  # noqa: F841
        second.close()


def test_a_corpus_tokenised_in_process_and_by_prepare_gets_the_same_ids():
    """``data.path``'s in-process tokenising and ``prepare``'s Ray Data actors share one step
    (``encode_documents``); it gives the ids a transformers tokenizer's own call gave before (so
    the default run's 1.9199 and every cached corpus stay as they were), for the plain and the
    special-token char vocabularies and a BPE, with EOS after each document; a text file's lines
    keep their newline and get no EOS."""
    from helpers import SHAKESPEARE

    from ray_diloco.components.prepare import Tokenize
    from ray_diloco.components.text import bpe_tokenizer, char_tokenizer, encode_documents, tokenize

    text = SHAKESPEARE.read_text()[:20000]
    docs = [text[:7000], text[7000:12000], text[12000:]]
    for tok in (char_tokenizer(docs), char_tokenizer(docs, specials=True), bpe_tokenizer(docs, 300)):
        eos = tok.eos_token_id
        before = np.concatenate([np.asarray(ids + ([eos] if eos is not None else []), np.int32)
                                 for ids in tok(docs, add_special_tokens=False)["input_ids"]])  # fmt: skip
        assert np.array_equal(tokenize(tok, docs), before)
        actor = Tokenize(tok.backend_tokenizer.to_str(), eos, "text", False, 0.0, "<u4")
        out = actor({"text": np.array(docs, dtype=object)})
        assert np.array_equal(np.frombuffer(out["train"][0], "<u4"), before)
    lines = encode_documents(tok.backend_tokenizer, ["a b", "", "c"], tok.eos_token_id, lines=True)
    assert [tok.decode(ids) for ids in lines] == ["a b\n", "\n", "c\n"]
