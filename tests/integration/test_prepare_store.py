"""``ray-diloco prepare`` (issue 15) on a real local Ray and real Ray Data: text, JSONL and a
``datasets`` source, the val split by hash, a killed prepare that continues, one-line errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, SHAKESPEARE, one_error_line, run_cli, run_main

from ray_diloco.components.prepare import PrepareOptions, prepare_store
from ray_diloco.components.text import tokenize
from ray_diloco.components.token_store import TokenStore, tail_tokens
from ray_diloco.errors import DataError


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """Three text files of real text (90 kB)."""
    d = tmp_path_factory.mktemp("src")
    text = SHAKESPEARE.read_text()
    for i in range(3):
        (d / f"part{i}.txt").write_text(text[i * 30000 : (i + 1) * 30000])
    return d


def test_text_files_are_tokenised_in_order_and_read_back(ray_session, text_dir, tmp_path):
    m = prepare_store(PrepareOptions(sources=[str(text_dir)], out=str(tmp_path / "s"), tokenizer="bpe",
                                     bpe_vocab_size=400, val_fraction=0.0, shard_tokens=5000, progress=False))
    st = TokenStore(str(tmp_path / "s"))
    assert m["tokens"]["val"] == 0 and len(m["shards"]["train"]) > 3
    assert all(e["tokens"] == 5000 for e in m["shards"]["train"][:-1])
    tr = st.split("train")
    parts = [(text_dir / f"part{i}.txt").read_text() for i in range(3)]
    text = "".join(p if p.endswith("\n") else p + "\n" for p in parts)  # a row per line, newline kept
    assert st.tokenizer().decode(tr.to_array().tolist()) == text  # every line once, in source order


def test_jsonl_val_split_is_by_hash_of_the_document(ray_session, tmp_path):
    src = tmp_path / "docs.jsonl"
    docs = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(30)) for i in range(400)]
    src.write_text("".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    m = prepare_store(PrepareOptions(sources=[str(src)], out=str(tmp_path / "s"), tokenizer="char", text_field="body",
                                     val_fraction=0.2, shard_tokens=4096, actors=2, progress=False))
    want_val = [d for d in docs if zlib.crc32(d.encode()) < int(0.2 * 2**32)]
    assert m["documents"] == {"train": 400 - len(want_val), "val": len(want_val)}
    st = TokenStore(str(tmp_path / "s"))
    tok = st.tokenizer()
    val = st.split("val").to_array()
    assert (val == tok.eos_token_id).sum() == len(want_val)  # EOS after every document
    assert tok.decode(val.tolist(), skip_special_tokens=True) == "".join(want_val)
    with pytest.raises(DataError, match=r"--text-field 'text': not a column of the source \(columns: body, n\)"):
        prepare_store(PrepareOptions(sources=[str(src)], out=str(tmp_path / "s2"), tokenizer="char", progress=False))
    assert not (tmp_path / "s2" / "manifest.json").exists()
    # the same documents as CSV (a file type data.path reads too): the same split, the same tokens
    import pyarrow as pa
    import pyarrow.csv as pacsv

    pacsv.write_csv(pa.table({"body": docs, "n": list(range(400))}), str(tmp_path / "docs.csv"))
    prepare_store(PrepareOptions(sources=[str(tmp_path / "docs.csv")], out=str(tmp_path / "c"), tokenizer="char",
                                 text_field="body", val_fraction=0.2, shard_tokens=4096, actors=2, progress=False))
    csv_store = TokenStore(str(tmp_path / "c"))
    assert np.array_equal(csv_store.split("val").to_array(), val)
    assert np.array_equal(csv_store.split("train").to_array(), st.split("train").to_array())


def test_a_rowless_first_file_does_not_stop_a_named_tokenizer(ray_session, tmp_path):
    """With a tokenizer file, only the first files are read to check the column; a first Parquet
    file with no rows (as Spark writes) falls back to the whole source instead of 'no rows'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_diloco.components.text import char_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    docs = [f"document {i} " * 20 for i in range(50)]
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), src / "part-00000.parquet")
    pq.write_table(pa.table({"text": docs}), src / "part-00001.parquet")
    tok = char_tokenizer(docs)
    tok.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    m = prepare_store(PrepareOptions(sources=[str(src)], out=str(tmp_path / "s"), tokenizer=str(tmp_path / "tokenizer.json"),
                                     val_fraction=0.1, val_split="tail", shard_tokens=1024, progress=False))
    assert m["documents"]["train"] == 50
    # --val-split tail: data.path's rule (the last 10% of the stream) applied by the store writer,
    # also when finished shards hold the tail: the tokens of tokenising in process, split the same
    ids = tokenize(tok, docs)
    cut = len(ids) - tail_tokens(len(ids), 0.1)
    store = TokenStore(str(tmp_path / "s"))
    assert m["split"] == {"method": "tail", "val_fraction": 0.1} and len(m["shards"]["val"]) == 2
    np.testing.assert_array_equal(store.split("train").to_array(), ids[:cut])
    np.testing.assert_array_equal(store.split("val").to_array(), ids[cut:])


def test_a_datasets_source_is_streamed_through_the_hub_code_path(ray_session, tmp_path):
    ds_dir = tmp_path / "local_dataset"  # load_dataset(DIR, streaming=True): the hub loader on local files
    ds_dir.mkdir()
    (ds_dir / "train.jsonl").write_text("".join(json.dumps({"content": f"row {i} " * 20}) + "\n" for i in range(300)))
    m = prepare_store(PrepareOptions(dataset=str(ds_dir), split="train", out=str(tmp_path / "s"), tokenizer="char",
                                     text_field="content", val_fraction=0.1, shard_tokens=2048, progress=False))
    assert sum(m["documents"].values()) == 300 and m["source"]["dataset"] == str(ds_dir)
    assert m["tokens"]["train"] + m["tokens"]["val"] == sum(len(f"row {i} " * 20) + 1 for i in range(300))


def test_bad_sources_are_one_line_errors(ray_session, tmp_path):
    """Through the CLI's main in this process (on the session's cluster if it got that far)."""
    line = one_error_line(run_main(["prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "s")]),
                          "no such file")
    assert line.startswith("error: SOURCE ")
    (tmp_path / "empty.txt").write_text("")
    one_error_line(run_main(["prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "s")]),
                   "every file is empty")
    one_error_line(run_main(["prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "s"), "--val-fraction",
                             "1.5"]), "--val-fraction = 1.5: must be in [0, 1)")
    (tmp_path / "a_file").write_text("keep me")  # --out under a file: refused before Ray starts, the file kept
    one_error_line(run_main(["prepare", str(SHAKESPEARE), "--out", str(tmp_path / "a_file" / "store")]),
                   "is a file, not a directory")
    assert (tmp_path / "a_file").read_text() == "keep me"
    # a line that is not JSON fails inside Ray Data: its reason, not Ray Data's retry advice (a break-it run)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    line = one_error_line(run_main(["prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "b"),
                                    "--tokenizer", "char", "--no-progress"]), "prepare failed: ")  # fmt: skip
    assert "retr" not in line and "JSON" in line.upper(), line
    # bytes that are not UTF-8, in the second of two files: that file and the offset (Ray garbles the error's text)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("fine text\n" * 50)
    (tmp_path / "txt" / "b.txt").write_bytes(b"more text\n" * 30 + b"\xff\xfe latin-1?\n")
    one_error_line(run_main(["prepare", str(tmp_path / "txt"), "--out", str(tmp_path / "u"), "--tokenizer", "char",
                             "--no-progress"]),
                   f"prepare failed: {tmp_path / 'txt' / 'b.txt'}: not UTF-8 text (near byte 300: invalid start byte)")
    # RAY_ADDRESS (joined as under ray job submit) where nothing answers: one line at once, out of
    # process (this one has joined the session's cluster already)
    r = run_cli(["prepare", str(SHAKESPEARE), "--out", str(tmp_path / "s")], timeout=60,
                env={"RAY_ADDRESS": "127.0.0.1:1"})
    one_error_line(r, "RAY_ADDRESS = '127.0.0.1:1': no Ray cluster answers there")
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def many_shards(ray_session, tmp_path_factory) -> tuple[list[str], Path]:
    """The arguments (without ``--out``) of a prepare of eight 120 kB text files into shards of
    20,000 tokens (about 50 shards, so it can be stopped part way), and the store of one
    uninterrupted run of it (made once, in this process, on the session's cluster)."""
    root = tmp_path_factory.mktemp("many")
    src = root / "src"
    src.mkdir()
    text = SHAKESPEARE.read_text()
    for i in range(8):
        (src / f"p{i}.txt").write_text(text[i * 120000 : (i + 1) * 120000])
    args = ["prepare", str(src), "--tokenizer", "char", "--shard-tokens", "20000", "--val-fraction", "0.05",
            "--actors", "1", "--no-progress"]
    ref = run_main([*args, "--out", str(root / "ref")])
    assert ref.returncode == 0, ref.stderr
    return args, root / "ref"


def _same_store(a: Path, b: Path) -> None:
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert ma["shards"] == mb["shards"] and ma["documents"] == mb["documents"]  # as one uninterrupted run
    assert np.array_equal(TokenStore(str(a)).split("val").to_array(), TokenStore(str(b)).split("val").to_array())


# Runs the CLI in a process that SIGKILLs itself as it starts its third save of the prepare's state:
# the shards of the batch that filled them are written, the state naming them is not. A kill from
# outside cannot land there: the writes after the first shard take about 0.1 s.
KILLED_AT_THIRD_STATE = """
import os, runpy, signal, sys
from ray_diloco.components.token_store import StoreWriter
save, calls = StoreWriter._save_state, []
def _save_state(self):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    save(self)
StoreWriter._save_state = _save_state
sys.argv = ["ray-diloco", *sys.argv[1:]]
runpy.run_module("ray_diloco.cli", run_name="__main__")
"""


@pytest.mark.slow
def test_a_killed_prepare_continues_and_keeps_its_finished_shards(tmp_path, many_shards, ray_address):
    """A prepare process (joined to the session's cluster) SIGKILLed part way, after shards it had
    not yet recorded; the rerun (in this process) continues and gives the store of one
    uninterrupted run."""
    args, ref = many_shards
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ray_address}
    p = subprocess.run([sys.executable, "-c", KILLED_AT_THIRD_STATE, *args, "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not (out / "manifest.json").exists() and (out / "prepare-state.npz").exists()
    kept = {f.name: f.stat().st_ino for f in out.glob("train-*.bin")}
    with np.load(out / "prepare-state.npz") as z:
        state_shards = [e["file"] for e in json.loads(z["state"].tobytes())["shards"]["train"]]
    assert state_shards and set(state_shards) < set(kept)  # shards past the state's last save exist
    with pytest.raises(DataError, match="its prepare has not finished: rerun it to continue"):
        TokenStore(str(out))
    r = run_main([*args, "--out", str(out)])
    assert r.returncode == 0 and "finished shards kept" in r.stderr, r.stderr
    _same_store(ref, out)
    # the shards the state recorded before the kill are kept as they are (not rewritten); those
    # written after its last save are redone
    assert all((out / n).stat().st_ino == kept[n] for n in state_shards)
    assert any((out / n).stat().st_ino != kept[n] for n in set(kept) - set(state_shards))


@pytest.mark.slow
def test_a_full_disk_stops_prepare_in_one_line_and_a_rerun_continues(tmp_path, many_shards):
    """A real full disk (a 300 kB tmpfs; needs root to mount, as on CI): the prepare stops with one
    line naming the store and "disk full", writes no manifest and keeps its finished shards; once
    there is room, a rerun continues and gives the store of one uninterrupted run."""
    args, ref = many_shards
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out = mnt / "store"
        r = run_main([*args, "--out", str(out)])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and str(out) in last and "disk full" in last, last
        assert not (out / "manifest.json").exists()
        kept = {f.name: f.stat().st_ino for f in out.glob("train-*.bin")}
        assert len(kept) >= 3, kept
        assert not list(out.glob(".tmp-*"))  # the shard being written when the disk filled is not left behind
        assert subprocess.run(["mount", "-o", "remount,size=20m", str(mnt)]).returncode == 0
        r = run_main([*args, "--out", str(out)])
        assert r.returncode == 0 and "finished shards kept" in r.stderr, r.stderr
        _same_store(ref, out)
        first = sorted(kept)[0]
        assert (out / first).stat().st_ino == kept[first]  # a finished shard was kept, not rewritten
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_prepare_writes_a_store_to_s3_that_reads_back_as_the_local_one(ray_session, text_dir, tmp_path, s3_bucket):
    """``--out s3://...`` (a real S3 protocol server, moto): the shards, tokenizer and manifest land
    in the bucket, the store reads back through the remote reader with the same id and tokens as
    the same prepare written to a local directory; a second prepare to the same URI is refused in
    one line and the store stays as it was."""
    opts = dict(sources=[str(text_dir)], tokenizer="char", val_fraction=0.1, shard_tokens=8192, progress=False)
    uri = s3_bucket.replace("/runs?", "/stores/prepared?")
    local = prepare_store(PrepareOptions(out=str(tmp_path / "local"), **opts))
    remote = prepare_store(PrepareOptions(out=uri, **opts))
    assert remote["tokens"] == local["tokens"] and remote["shards"] == local["shards"]
    a, b = TokenStore(str(tmp_path / "local")), TokenStore(uri)
    assert a.id == b.id
    for split in ("train", "val"):
        np.testing.assert_array_equal(a.split(split).to_array(), b.split(split).to_array())
    with pytest.raises(DataError, match=r"already holds a prepared store \(manifest.json\); choose another --out"):
        prepare_store(PrepareOptions(out=uri, **opts))
    assert TokenStore(uri).id == b.id  # untouched


def test_a_missing_remote_file_or_bucket_reads_as_absent(s3_bucket):
    """A store on S3 (moto) asks the filesystem whether a file it cannot read exists: a missing
    file, or a bucket that does not exist, reads as absent (None), never matched in an error's
    text; what exists reads back."""
    from ray_diloco.components.storage import Location

    store = Location(s3_bucket.replace("/runs?", "/stores/s?"))
    assert store.read_bytes("manifest.json") is None
    store.write_bytes("manifest.json", b"{}")
    assert store.read_bytes("manifest.json") == b"{}"
    nowhere = Location(s3_bucket.replace("s3://bucket-", "s3://no-such-bucket-"))
    assert nowhere.read_bytes("manifest.json") is None


def test_a_big_data_path_file_goes_through_the_prepare_pipeline_into_the_same_corpus(ray_session, tmp_path, caplog):
    """``data.path`` above ``data.in_process_bytes`` is tokenised by prepare's Ray Data pipeline
    into the cache (issue 28 item 4: one pipeline, two executors): with the same tokenizer, its
    splits hold the tokens of the in-process path (the tail split applied by the store writer);
    the manifest records the split and the window order, which the splits carry; a second load
    reads the cache; a missing text field is named as the run's field (``data.text_field``)."""
    from ray_diloco.components.data import load_corpus
    from ray_diloco.components.text import char_tokenizer
    from ray_diloco.config import DataConfig

    docs = [f"document {i}: " + "the quick brown fox " * (i % 7 + 1) for i in range(400)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    char_tokenizer(docs).save_pretrained(str(tmp_path / "tok"))
    cfg = dict(path=str(src), text_field="body", tokenizer=str(tmp_path / "tok"), seq_len=16, val_fraction=0.1)
    small = load_corpus(DataConfig(cache_dir=str(tmp_path / "c1"), **cfg))
    big = load_corpus(DataConfig(cache_dir=str(tmp_path / "c2"), in_process_bytes=0, **cfg))
    np.testing.assert_array_equal(np.asarray(big.train), np.asarray(small.train))
    np.testing.assert_array_equal(np.asarray(big.val), np.asarray(small.val))
    assert (small.train.order, big.train.order) == ("strided", "feistel")
    (entry,) = (tmp_path / "c2" / "tokens").iterdir()
    m = json.loads((entry / "manifest.json").read_text())
    assert m["split"] == {"method": "tail", "val_fraction": 0.1} and m["order"] == "feistel"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ray_diloco.components.data"):
        again = load_corpus(DataConfig(cache_dir=str(tmp_path / "c2"), in_process_bytes=0, **cfg))
    assert again.fingerprint == big.fingerprint and "Ray Data" not in caplog.text
    # prepare's errors name the run's fields here, not prepare's flags
    with pytest.raises(DataError, match=r"data.text_field 'nope': not a column") as e:
        load_corpus(DataConfig(cache_dir=str(tmp_path / "c3"), in_process_bytes=0, **{**cfg, "text_field": "nope"}))
    assert "--" not in str(e.value), e.value
    with pytest.raises(DataError, match=r"data.bpe_vocab_size = 100: must be at least 260") as e:
        load_corpus(DataConfig(cache_dir=str(tmp_path / "c3"), in_process_bytes=0,
                               **{**cfg, "tokenizer": "bpe", "bpe_vocab_size": 100}))  # fmt: skip
    assert "--" not in str(e.value), e.value
