"""The token store (issue 15): the Feistel window order, shards, checksums, resume positions."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from ray_diloco.components.data import ShardReader
from ray_diloco.components.permutation import FeistelPermutation
from ray_diloco.components.text import char_tokenizer
from ray_diloco.components.token_store import TokenStore, dtype_for, write_store
from ray_diloco.errors import DataError


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097, 65536])
def test_feistel_is_a_bijection_keyed_by_seed_and_epoch(n):
    out = FeistelPermutation(n, seed=1, epoch=0)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    if n >= 1000:
        assert not np.array_equal(out, np.arange(n))  # it shuffles
        assert not np.array_equal(out, FeistelPermutation(n, seed=1, epoch=1)(np.arange(n)))
        assert not np.array_equal(out, FeistelPermutation(n, seed=2, epoch=0)(np.arange(n)))
        np.testing.assert_array_equal(out[[5, 17]], FeistelPermutation(n, 1, 0)(np.array([5, 17])))  # per index


def test_feistel_of_a_huge_domain_is_computed_per_index():
    p = FeistelPermutation(10**12 + 7, seed=0, epoch=3)
    x = p(np.arange(1000))
    assert len(set(x.tolist())) == 1000 and x.max() < 10**12 + 7


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of 2 x 1000-token-ish train shards (shard_tokens 700) built from real text."""
    text = (Path(__file__).parents[3] / "ray_diloco" / "data" / "tinyshakespeare.txt").read_text()[:3000]
    tok = char_tokenizer([text])
    ids = np.asarray(tok(text)["input_ids"], dtype=np.int64)
    out = tmp_path_factory.mktemp("store") / "s"
    return write_store(str(out), tok, ids[:2700], ids[2700:], {"split": {"method": "tail"}, "order": "feistel"},
                       shard_tokens=700), ids


def test_store_layout_dtype_and_reads_across_shard_boundaries(store):
    st, ids = store
    m = json.loads((Path(st.where) / "manifest.json").read_text())
    assert m["dtype"] == "uint16" and [e["tokens"] for e in m["shards"]["train"]] == [700, 700, 700, 600]
    assert dtype_for(70000) == np.dtype("<u4")
    tr = st.split("train")
    assert len(tr) == 2700
    np.testing.assert_array_equal(tr[690:1410], ids[690:1410])  # three shards
    np.testing.assert_array_equal(st.split("val").to_array(), ids[2700:])
    small = pickle.dumps(tr)
    assert len(small) < 4000  # its address, not its tokens
    np.testing.assert_array_equal(pickle.loads(small)[0:50], ids[:50])
    assert st.tokenizer().decode(tr[0:20].tolist()) == st.tokenizer().decode(ids[:20].tolist())


def test_feistel_shards_are_disjoint_and_cover_each_epoch(store):
    st, _ = store
    S, T = 5, 16
    readers = [ShardReader(st.split("train"), T, s, S, seed=3) for s in range(S)]
    assert readers[0].order == "feistel"
    per = readers[0].per_shard
    for _ in range(2):  # two epochs
        seen = np.concatenate([r.next_indices(per) for r in readers])
        assert len(np.unique(seen[:, 0])) == 1
        assert len(np.unique(seen[:, 1])) == per * S  # no window read twice in the epoch
        assert seen[:, 1].max() < readers[0].n_windows


def test_resume_is_exact(store):
    st, _ = store
    a = ShardReader(st.split("train"), 16, 2, 4, seed=9)
    a.next_batch(7)
    state = json.loads(json.dumps(a.state()))  # a few integers, through a checkpoint
    xa, ya, ia = a.next_batch(40)  # crosses into the next epoch
    b = ShardReader(pickle.loads(pickle.dumps(st.split("train"))), 16, 2, 4, seed=9)
    b.load_state(state)
    xb, yb, ib = b.next_batch(40)
    assert np.array_equal(ia, ib) and bool((xa == xb).all()) and bool((ya == yb).all())
    assert ia[:, 0].max() == 1


def test_corrupt_shard_is_refused(store, tmp_path):
    import shutil

    st, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(st.where, copy)
    raw = bytearray((copy / "train-00001.bin").read_bytes())
    raw[10] ^= 0xFF
    (copy / "train-00001.bin").write_bytes(bytes(raw))
    tr = TokenStore(str(copy)).split("train")
    tr[0:700]  # shard 0 is intact
    with pytest.raises(DataError, match=r"train-00001.bin fails its checksum"):
        tr[700:720]
    (copy / "train-00002.bin").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match=r"train-00002.bin holds 10 bytes"):
        tr[1400:1401]


def test_changed_tokenizer_or_missing_manifest_is_refused(store, tmp_path):
    import shutil

    st, _ = store
    copy = tmp_path / "copy"
    shutil.copytree(st.where, copy)
    tj = copy / "tokenizer" / "tokenizer.json"
    tj.write_text(tj.read_text().replace('"a"', '"A"', 1))
    with pytest.raises(DataError, match="tokenizer.json is missing or differs"):
        TokenStore(str(copy)).tokenizer()
    (copy / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"data.prepared = .*: no manifest.json \(prepare one"):
        TokenStore(str(copy))


def test_tail_split_in_the_writer_equals_the_in_memory_rule_across_finished_shards(store, tmp_path):
    """``data.path``'s tail split as an option of the one store writer (issue 28 item 4): the last
    ``round(total x fraction)`` tokens become val even when finished train shards hold them (read
    back, written again under new names, the old files deleted after the manifest)."""
    from ray_diloco.components.token_store import StoreWriter, tail_tokens

    _, ids = store
    tok = char_tokenizer([store[0].tokenizer().decode(ids.tolist())])
    for fraction, shard_tokens in [(0.1, 700), (0.5, 400), (0.0, 700), (0.1, 5000)]:
        out = tmp_path / f"t{fraction}-{shard_tokens}"
        w = StoreWriter(str(out), len(tok), shard_tokens)
        for a in range(0, len(ids), 450):  # batches: shards fill up and are written as they go
            w.add(ids[a : a + 450], np.zeros(0, np.int64), {"at": a})
        m = w.finish(tok, {"split": {"method": "tail", "val_fraction": fraction}}, tail=fraction)
        st, cut = TokenStore(str(out)), len(ids) - tail_tokens(len(ids), fraction)
        np.testing.assert_array_equal(st.split("train").to_array(), ids[:cut])
        np.testing.assert_array_equal(st.split("val").to_array(), ids[cut:])
        files = sorted(p.name for p in out.glob("*.bin"))
        assert files == sorted(e["file"] for s in ("train", "val") for e in m["shards"][s])  # none left behind
        assert all(e["tokens"] <= shard_tokens for s in ("train", "val") for e in m["shards"][s])
        if shard_tokens == 5000:  # nothing finished before the split: the plain names
            assert files == ["train-00000.bin", "val-00000.bin"]
    w = StoreWriter(str(tmp_path / "bad"), len(tok), 700)
    w.add(ids[:100], ids[100:200], {})
    with pytest.raises(DataError, match="tail split"):
        w.finish(tok, {}, tail=0.1)
