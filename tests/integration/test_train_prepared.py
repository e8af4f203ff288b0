"""Training on a prepared token store (issue 15, ``data.prepared``) with a real local Ray: local
and on S3 (a real moto server), a resume that refuses another store, ``run.eval_tokens``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import SHAKESPEARE, tiny_overrides, torch_lm

from ray_diloco.components.data import char_tokenizer
from ray_diloco.components.token_store import TokenStore, write_store
from ray_diloco.errors import CheckpointError, ConfigError, DataError
from ray_diloco.runtime.launcher import train

pytest.importorskip("moto")
from test_storage import s3_bucket  # noqa: E402,F401  (the fixture: a moto S3 server on loopback)


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
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
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
    uri = s3_bucket.replace("s3://bucket/runs", "s3://bucket/stores/shakespeare")
    from ray_diloco.components.token_store import Location

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
