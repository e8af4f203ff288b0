"""The small path's cache (issue 15): a local file is tokenised once into a token store, keyed by
its bytes, the tokenizer and the settings, and read back through the same reader."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.components import data as D
from ray_diloco.components.data import ShardReader, cache_key, load_corpus
from ray_diloco.components.text import char_tokenizer
from ray_diloco.config import DataConfig
from ray_diloco.errors import DataError

TEXT = (Path(__file__).parents[3] / "ray_diloco" / "data" / "tinyshakespeare.txt").read_text()[:60_000]


@pytest.fixture
def src(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def cfg_for(src: Path, cache: Path, **kw) -> DataConfig:
    return DataConfig(path=str(src), cache_dir=str(cache), seq_len=16, **kw)


def entries(cache: Path) -> list[str]:
    root = cache / "tokens"
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def no_tokenising(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("tokenised although the cache holds the entry")

    monkeypatch.setattr(D, "tokenize", fail)
    monkeypatch.setattr(D, "load_texts", fail)


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_cached_tokens_equal_tokenising_in_process_and_a_second_load_reads_the_entry(src, tmp_path, monkeypatch,
                                                                                    tokenizer):
    cfg = cfg_for(src, tmp_path / "cache", tokenizer=tokenizer, bpe_vocab_size=300)
    ref = D._tokenized(cfg, None)  # what every run did before the cache
    first = load_corpus(cfg)
    assert len(entries(tmp_path / "cache")) == 1
    no_tokenising(monkeypatch)
    second = load_corpus(cfg)
    for c in (first, second):
        np.testing.assert_array_equal(c.train.to_array(), ref.train)
        np.testing.assert_array_equal(c.val.to_array(), ref.val)
        assert c.fingerprint == ref.fingerprint  # checkpoints made before the cache resume
        assert c.vocab_size == ref.vocab_size and c.train.order == "strided"
        assert c.tokenizer.backend_tokenizer.to_str() == ref.tokenizer.backend_tokenizer.to_str()
    # the reader sees the same windows and batches as over the int32 arrays
    for a, b in ((ShardReader(second.train, 16, 1, 3, seed=5), ShardReader(ref.train, 16, 1, 3, seed=5)),):
        for _ in range(4):
            (xa, ya, ia), (xb, yb, ib) = a.next_batch(7), b.next_batch(7)
            assert np.array_equal(ia, ib) and xa.equal(xb) and ya.equal(yb)
    # an entry written while the strided order was called legacy reads the same windows
    manifest = tmp_path / "cache" / "tokens" / entries(tmp_path / "cache")[0] / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"order": "strided"', '"order": "legacy"'))
    assert '"order": "legacy"' in manifest.read_text()
    old = load_corpus(cfg)
    assert old.train.order == "strided" and old.fingerprint == ref.fingerprint
    # it reaches a worker by value (an in-memory split), not as a path on this machine's disk
    back = pickle.loads(pickle.dumps(second.train))
    np.testing.assert_array_equal(back.to_array(), ref.train)


def test_the_key_follows_the_bytes_the_tokenizer_and_the_settings(src, tmp_path):
    cfg = cfg_for(src, tmp_path / "cache")
    k = cache_key(cfg, src)
    assert cache_key(cfg_for(src, tmp_path / "other"), src) == k  # not where the cache is
    assert cache_key(cfg_for(src, tmp_path / "c", val_fraction=0.2), src) != k
    assert cache_key(cfg_for(src, tmp_path / "c", tokenizer="bpe"), src) != k
    assert cache_key(cfg_for(src, tmp_path / "c", max_documents=3), src) != k
    run_tok = load_corpus(cfg).tokenizer
    assert cache_key(cfg, src, run_tok) != k  # a resume keys by the run's own tokenizer
    src.write_text(TEXT[:-1] + "X")
    assert cache_key(cfg, src) != k
    c = load_corpus(cfg)
    assert len(entries(tmp_path / "cache")) == 2 and c.fingerprint == D._tokenized(cfg, None).fingerprint


def test_a_resume_with_the_runs_tokenizer_reads_the_first_runs_entry(src, tmp_path, monkeypatch):
    """A resume passes the run's saved tokenizer: the entry its first run wrote (keyed by the
    char/bpe recipe) is used when it holds that same tokenizer; another tokenizer gets its own."""
    from ray_diloco.components.token_store import load_saved_tokenizer

    cfg = cfg_for(src, tmp_path / "cache")
    first = load_corpus(cfg)
    first.tokenizer.save_pretrained(str(tmp_path / "run-tok"))
    tok = load_saved_tokenizer(tmp_path / "run-tok")  # as --resume loads it
    with monkeypatch.context() as m:
        no_tokenising(m)
        a = load_corpus(cfg, tokenizer=tok)
    assert a.tokenizer is tok and a.fingerprint == first.fingerprint and len(entries(tmp_path / "cache")) == 1
    other = char_tokenizer([TEXT + "~"])  # one more character: another vocabulary
    b = load_corpus(cfg, tokenizer=other)
    assert len(entries(tmp_path / "cache")) == 2 and b.vocab_size == a.vocab_size + 1


def test_a_slow_tokenizer_is_not_cached(src, tmp_path):
    class Slow:  # a tokenizer without a tokenizers backend (no JSON to key the cache by)
        eos_token_id = None

        def __init__(self, fast):
            self.fast = fast

        def __call__(self, texts, **kw):
            return self.fast(texts, **kw)

        def __len__(self):
            return len(self.fast)

    fast = load_corpus(cfg_for(src, tmp_path / "cache")).tokenizer
    c = load_corpus(cfg_for(src, tmp_path / "cache2"), tokenizer=Slow(fast))
    assert isinstance(c.train, np.ndarray) and entries(tmp_path / "cache2") == []


def test_a_damaged_entry_is_rebuilt(src, tmp_path):
    cfg = cfg_for(src, tmp_path / "cache")
    good = load_corpus(cfg).fingerprint
    (entry,) = entries(tmp_path / "cache")
    shard = tmp_path / "cache" / "tokens" / entry / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert load_corpus(cfg).fingerprint == good
    assert entries(tmp_path / "cache") == [entry]


def test_an_unwritable_cache_leaves_the_corpus_in_memory_with_one_note(src, tmp_path, caplog):
    """A cache directory nobody may write: a read-only mount (root, as on CI, writes through
    permission bits) or, for another user, a directory without write permission."""
    cache = tmp_path / "ro"
    cache.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(cache)], capture_output=True)
        assert mounted.returncode == 0, mounted.stderr
        undo = ["umount", "-l", str(cache)]
    else:
        cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
        undo = ["chmod", "700", str(cache)]
    try:
        c = load_corpus(cfg_for(src, cache))
    finally:
        subprocess.run(undo, check=True)
    assert isinstance(c.train, np.ndarray) and c.fingerprint == D._tokenized(cfg_for(src, cache), None).fingerprint
    notes = [r.getMessage() for r in caplog.records if r.name.startswith("ray_diloco")]  # a warning: printed by default
    assert len(notes) == 1 and notes[0].startswith("note: data.cache_dir") and "stays in memory" in notes[0]
    assert caplog.records[-1].levelname == "WARNING"


def test_a_file_as_cache_dir_leaves_the_corpus_in_memory(src, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    c = load_corpus(cfg_for(src, blocker))
    assert isinstance(c.train, np.ndarray) and "cannot cache" in caplog.text


def test_an_entry_finished_by_another_run_first_is_used(src, tmp_path, monkeypatch):
    """Two trials starting together: the second one's rename fails, it uses the first's entry."""
    cfg = cfg_for(src, tmp_path / "cache")
    real = os.rename

    def race(a, b):
        if Path(b).parent != tmp_path / "cache" / "tokens":
            return real(a, b)  # datasets' own renames
        real(a, b)  # the other run's entry lands first...
        raise OSError(39, "Directory not empty")  # ...so this run's own rename fails

    monkeypatch.setattr(D.os, "rename", race)
    c = load_corpus(cfg)
    assert entries(tmp_path / "cache") == [cache_key(cfg, src)]
    assert c.train.order == "strided" and c.fingerprint == D._tokenized(cfg, None).fingerprint
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.name.startswith(".")]  # no temp left


def test_bad_sources_and_too_short_corpora_are_still_one_line(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_corpus(cfg_for(tmp_path / "nope.txt", tmp_path / "c"))
    (tmp_path / "a.xyz").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type"):
        load_corpus(cfg_for(tmp_path / "a.xyz", tmp_path / "c"))
    short = tmp_path / "short.txt"
    short.write_text(TEXT[:5000])
    load_corpus(cfg_for(short, tmp_path / "c"))  # fits seq_len 16, cached
    with pytest.raises(DataError, match="too small"):  # the cached entry is checked against seq_len too
        load_corpus(DataConfig(path=str(short), cache_dir=str(tmp_path / "c"), seq_len=1024))


def test_a_killed_runs_temporary_entry_is_removed_once_stale(src, tmp_path):
    """A run killed while writing an entry leaves ``.KEY-*``; the next entry written removes it
    after an hour (a fresh one may be another run's, still writing, and is kept)."""
    root = tmp_path / "cache" / "tokens"
    old, fresh = root / ".abc-killed", root / ".def-writing"
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "train-00000.bin").write_bytes(b"x" * 10)
    os.utime(old, (0, 0))
    load_corpus(cfg_for(src, tmp_path / "cache"))
    assert not old.exists() and fresh.exists() and len(entries(tmp_path / "cache")) == 1
