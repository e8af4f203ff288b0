"""Training on a prepared token store (issue 15, ``data.prepared``) with a real local Ray: local
and on S3 (a real moto server), a resume that refuses another store, ``run.eval_tokens``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import SHAKESPEARE, data_windows, read_metrics, tiny_overrides, torch_lm

from ray_diloco.components.text import char_tokenizer
from ray_diloco.components.token_store import TokenStore, write_store
from ray_diloco.errors import CheckpointError, ConfigError, DataError
from ray_diloco.runtime.launcher import train


def _store(where: str, start: int = 0, n: int = 40000) -> TokenStore:
    text = SHAKESPEARE.read_text()[start : start + n]
    tok = char_tokenizer([SHAKESPEARE.read_text()])
    ids = np.asarray(tok(text)["input_ids"])
    cut = int(len(ids) * 0.9)
    return write_store(where, tok, ids[:cut], ids[cut:], {"split": {"method": "tail"}, "order": "feistel"},
                       shard_tokens=4096)


def test_a_run_reads_a_local_store_and_refuses_another_on_resume(ray_session, tmp_path):
    st = _store(str(tmp_path / "store"))
    cfg = tiny_overrides(tmp_path, data__prepared=st.where, run__steps=10, run__eval_tokens=161)
    summary = train(cfg, model_fn=torch_lm)
    assert np.isfinite(summary["final_eval_loss"]) and summary["final_eval_loss"] < np.log(st.vocab_size)
    run_dir = Path(summary["run_dir"])
    rows = read_metrics(run_dir)
    assert rows[-1]["eval_loss"] == summary["final_eval_loss"]
    # the same path now holds another store: the checkpoint's store id refuses it
    shutil.rmtree(st.where)
    _store(st.where, start=50000)
    with pytest.raises(CheckpointError, match="the corpus differs"):
        train(None, ["run.steps=15"], resume=run_dir, model_fn=torch_lm)
    with pytest.raises(ConfigError, match=r"data.prepared = .*: the checkpoint was trained with"):
        train(None, [f"data.prepared={tmp_path / 'other'}", "run.steps=15"], resume=run_dir, model_fn=torch_lm)


def test_a_run_reads_a_store_on_s3(ray_session, tmp_path, s3_bucket):
    local = _store(str(tmp_path / "store"))
    uri = s3_bucket.replace("/runs?", "/stores/shakespeare?")
    from ray_diloco.components.storage import Location

    loc = Location(uri)
    for f in sorted(Path(local.where).rglob("*")):
        if f.is_file():
            loc.write_bytes(str(f.relative_to(local.where)), f.read_bytes())
    remote = TokenStore(uri)
    assert remote.id == local.id
    np.testing.assert_array_equal(remote.split("train")[4000:4200], local.split("train")[4000:4200])
    summary = train(tiny_overrides(tmp_path, data__prepared=uri, run__steps=10), model_fn=torch_lm)
    assert np.isfinite(summary["final_eval_loss"])
    loc.write_bytes("train-00001.bin", b"\0" * (4096 * 2))  # damaged in place: refused when read
    with pytest.raises(DataError, match="train-00001.bin fails its checksum"):
        TokenStore(uri).split("train")[4096:4100]


def test_bad_prepared_values_are_one_line_errors(tmp_path):
    from ray_diloco.config import load_config

    with pytest.raises(ConfigError, match="a prepared store replaces data.path"):
        load_config(None, [f"data.prepared={tmp_path}", f"data.path={SHAKESPEARE}"])
    with pytest.raises(ConfigError, match=r"run.eval_tokens = 10: must be an integer > data.seq_len = 64"):
        load_config(None, ["run.eval_tokens=10"])
    with pytest.raises(DataError, match=r"data.prepared = .*: no manifest.json"):
        train(tiny_overrides(tmp_path, data__prepared=str(tmp_path)), model_fn=torch_lm)


def test_a_replacement_takes_over_its_slot_of_a_prepared_store(ray_session, tmp_path):
    """A run on a prepared store (Feistel window order): replica 1 is SIGKILLed, a replacement
    joins in its data slot and reads that slot's windows (the dead replica's, disjoint from
    replica 0's); every worker holds the driver's globals."""
    import os
    import signal
    import time

    import ray as ray_mod
    from helpers import start_trainer

    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config

    st = _store(str(tmp_path / "store"))
    cfg = load_config(tiny_overrides(tmp_path, data__prepared=st.where, run__steps=40, diloco__H=5,
                                     run__log_hashes=True, run__eval_every=0, run__checkpoint_every=0,
                                     diloco__cpus_per_worker=0.5))
    t = start_trainer(cfg, load_corpus(cfg.data), torch_lm)
    try:
        t.outer_step(1)
        w0, w1 = (set(data_windows(r.rank0).tolist()) for r in t.replicas)
        assert w0 and w1 and not (w0 & w1)
        os.kill(ray_mod.get(t.replicas[1].rank0.pid.remote(), timeout=10), signal.SIGKILL)
        row = t.outer_step(2)
        assert row["replicas_live"] == 1
        deadline = time.monotonic() + 120
        while not t.members.poll():
            assert time.monotonic() < deadline, "the replacement did not start"
            time.sleep(0.1)
        row = t.outer_step(3)  # replica 2 joins in slot 1
        assert [(r.index, r.slot) for r in t.replicas] == [(0, 0), (2, 1)]
        w2 = set(data_windows(t.replicas[1].rank0).tolist())
        assert w2 == w1 and not (w2 & w0)
        assert t.members.slot_readers[1][0] is not None  # the slot's read position, handed to the joiner
        row = t.outer_step(4)
        assert row["replicas_live"] == 2 and set(row["worker_global_sha256"]) == {row["global_sha256"]}
    finally:
        t.shutdown()
