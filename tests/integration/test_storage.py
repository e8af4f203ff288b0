"""run.storage_path (issue 5): a run mirrored to S3 (a real S3 protocol server, moto, on
loopback: the cloud itself cannot be reached from here) and to file:// and memory:// through
pyarrow and fsspec, and resumed from the URI on a machine without the local copy."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import read_metrics, tiny_overrides

from ray_diloco.components.mirror import download_run
from ray_diloco.components.storage import filesystem
from ray_diloco.config import load_config
from ray_diloco.errors import ConfigError
from ray_diloco.runtime.launcher import train


def _remote_files(uri: str) -> set[str]:
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return {i.path[len(path.rstrip("/")) + 1:] for i in infos if i.type == pafs.FileType.File}


def test_a_run_is_mirrored_to_s3_and_resumes_from_it_elsewhere(ray_session, tmp_path, corpus, s3_bucket):
    """Train 10 steps with run.storage_path=s3://...; the bucket holds the config, metrics,
    tokenizer, the kept checkpoints (pruned ones deleted), the summary and the exported model.
    Then the local directory is gone (another machine): --resume URI fetches the newest
    checkpoint (byte for byte) and continues to 15 steps, and the storage gets the new checkpoint."""
    store = s3_bucket
    over = dict(run__steps=10, run__keep_checkpoints=1, run__deterministic=True, run__storage_path=store,
                run__name="mirrored", diloco__cpus_per_worker=0.5)
    cfg = load_config(tiny_overrides(tmp_path, **over))
    uri = store.replace("/runs?", "/runs/mirrored?")
    stored_rows = []

    def remote_metrics(row):  # after each checkpoint, the stored metrics reach that outer step
        fs, path = filesystem(uri)
        with fs.open_input_stream(path + "/metrics.jsonl") as f:
            stored_rows.append((row["outer_step"], len(f.read().decode().splitlines())))

    summary = train(cfg, corpus=corpus, on_outer_step=remote_metrics)
    assert stored_rows == [(1, 1), (2, 2)]
    assert summary["storage_uri"] == uri
    files = _remote_files(uri)
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints/step_000002/state.pt",
            "final/config.json", "final/model.safetensors"} <= files, files
    assert not any(f.startswith("checkpoints/step_000001") for f in files), "pruned checkpoint still stored"
    local = tmp_path / "runs" / "mirrored"
    stored = (local / "checkpoints" / "step_000002" / "state.pt").read_bytes()
    shutil.rmtree(local)
    resumed = train(None, ["run.steps=15", "run.keep_checkpoints=5", f"run.output_dir={tmp_path / 'elsewhere'}"],
                    resume=uri, corpus=corpus)
    assert resumed["inner_steps"] == 15 and resumed["run_dir"] == str(tmp_path / "elsewhere" / "mirrored")
    assert "checkpoints/step_000003/state.pt" in _remote_files(uri)
    rows = read_metrics(tmp_path / "elsewhere" / "mirrored")
    assert [r["outer_step"] for r in rows] == [1, 2, 3]
    downloaded = tmp_path / "elsewhere" / "mirrored" / "checkpoints" / "step_000002" / "state.pt"
    assert downloaded.read_bytes() == stored  # the resume started from the uploaded bytes


def test_file_uri_mirror_prunes_and_downloads_the_newest_checkpoint(tmp_path):
    """pyarrow's local filesystem (file://): checkpoints are uploaded oldest first, ones pruned
    locally are deleted from the storage, a download fetches only the newest, and a mirror with
    keep (a resumed run elsewhere) keeps the newest stored ones."""
    from ray_diloco.components.mirror import Mirror

    run = tmp_path / "local" / "r1"
    for step in (1, 2):
        (run / "checkpoints" / f"step_00000{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_00000{step}" / "state.pt").write_bytes(bytes([step]) * 1000)
    (run / "config.yaml").write_text("run: {steps: 10}\n")
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    m = Mirror(run, f"file://{tmp_path / 'store'}")
    assert m.sync()
    store = tmp_path / "store" / "r1"
    assert sorted(p.name for p in (store / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    shutil.rmtree(run / "checkpoints" / "step_000001")  # pruned locally (keep_checkpoints)
    (run / "checkpoints" / "step_000003").mkdir()
    (run / "checkpoints" / "step_000003" / "state.pt").write_bytes(b"\3" * 1000)
    assert m.sync(final=False)
    assert sorted(p.name for p in (store / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert not any(p.name.startswith(".") for p in (store / "checkpoints" / "step_000003").iterdir())
    (store / "checkpoints" / "step_000003" / ".worker-0-0.pt.part").write_bytes(b"half")  # a killed upload's
    got = download_run(f"file://{store}", tmp_path / "elsewhere")
    assert [p.name for p in (got / "checkpoints").iterdir()] == ["step_000003"]
    assert [p.name for p in (got / "checkpoints" / "step_000003").iterdir()] == ["state.pt"]
    assert (got / "checkpoints" / "step_000003" / "state.pt").read_bytes() == b"\3" * 1000
    assert (got / "tokenizer" / "tokenizer.json").read_text() == "{}"
    # a resume elsewhere holds only the newest: with keep (run.keep_checkpoints) the storage keeps
    # the newest 3 of stored and local (step 2 too, which this machine never had), then prunes
    (got / "checkpoints" / "step_000004").mkdir()
    (got / "checkpoints" / "step_000004" / "state.pt").write_bytes(b"\4" * 10)
    again = Mirror(got, f"file://{tmp_path / 'store'}", keep=3)
    assert again.sync()
    assert sorted(p.name for p in (store / "checkpoints").iterdir()) == ["step_000002", "step_000003", "step_000004"]
    shutil.copytree(got / "checkpoints" / "step_000004", got / "checkpoints" / "step_000005")
    assert again.sync()
    assert sorted(p.name for p in (store / "checkpoints").iterdir()) == ["step_000003", "step_000004", "step_000005"]
    shutil.rmtree(store / "checkpoints")  # the storage refuses the upload: a warning, not a crash
    (store / "checkpoints").write_text("a file where a folder should be")
    (run / "checkpoints" / "step_000004").mkdir()
    (run / "checkpoints" / "step_000004" / "state.pt").write_bytes(b"\4")
    assert m.sync() is False
    assert (run / "checkpoints" / "step_000004" / "state.pt").read_bytes() == b"\4"  # local copy untouched


def test_fsspec_memory_filesystem_and_bad_uris(tmp_path):
    """Schemes pyarrow lacks go through fsspec (memory://); a resume from a URI with no run or
    an unknown scheme is one clear error."""
    import pyarrow.fs as pafs

    from ray_diloco.errors import CheckpointError

    fs, path = filesystem("memory://bucket/runs")
    assert isinstance(fs, pafs.PyFileSystem)
    with fs.open_output_stream(path + "/x/config.yaml") as f:
        f.write(b"run: {}\n")
    with pytest.raises(CheckpointError, match="no complete checkpoint there"):
        download_run("memory://bucket/runs/x", tmp_path)
    with pytest.raises(CheckpointError, match="not a run directory"):
        download_run("memory://bucket/runs/nothing", tmp_path)
    with pytest.raises(ConfigError, match=r"run.storage_path = 'nosuchscheme://b/r': no filesystem for this URI"):
        filesystem("nosuchscheme://b/r")


def test_log_model_uploads_the_exported_model_as_a_wandb_artifact(tmp_path, monkeypatch):
    """tracking.log_model: the exported model directory becomes an artifact of type "model" in
    the (offline) W&B run, with the final loss in its metadata. The log is read right after
    finish(): Tracker.finish returns only once W&B has written it (wandb-core writes a run's
    log when its stream closes, after run.finish() has returned: read then, it could be the
    7-byte header alone, which failed this test in a full run)."""
    from wandb_records import records

    from ray_diloco.components.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config({"tracking": {"wandb": True, "log_model": True, "progress": False}, "run": {"name": "art"}})
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    t = Tracker(cfg, tmp_path, total_steps=1)
    t.log({"outer_step": 1, "inner_step": 1, "train_loss": 1.5})
    t.finish({"final_eval_loss": 1.25, "export_dir": str(final), "num_parameters": 7})
    recs = records(next(tmp_path.glob("wandb/offline-run-*/run-*.wandb")))
    assert recs and recs[-1].WhichOneof("record_type") == "exit"  # the whole log, through the exit record
    arts = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact"]
    assert [(a.type, a.name) for a in arts] == [("model", "model-" + tmp_path.name)]
    assert json.loads(arts[0].metadata)["final_eval_loss"] == 1.25
    assert [f.path for f in arts[0].manifest.contents] == ["config.json"]


def test_checkpoint_writers_upload_their_own_files_to_the_storage(ray_session, tmp_path, corpus, caplog):
    """With run.storage_path, each worker and the driver upload the file they wrote straight to the
    storage (file:// here: every process sees it); the job's mirror then uploads only state.pt,
    last, which completes the stored checkpoint. A writer that cannot upload (a storage URI no
    writer reaches) leaves its file to the mirror, with one note."""
    from helpers import start_trainer, torch_lm

    from ray_diloco.components.mirror import Mirror

    store = f"file://{tmp_path / 'store'}"
    cfg = load_config(tiny_overrides(tmp_path, run__steps=10, run__name="up", diloco__cpus_per_worker=0.5))
    t = start_trainer(cfg, corpus, torch_lm, mirror_to=store)
    try:
        t.outer_step(1)
        t.checkpoint()
        remote = tmp_path / "store" / "up" / "checkpoints" / "step_000001"
        assert sorted(p.name for p in remote.iterdir()) == ["outer.pt", "worker-0-0.pt", "worker-1-0.pt"]
        local = t.run_dir / "checkpoints" / "step_000001"
        assert all((remote / n).read_bytes() == (local / n).read_bytes() for n in ("outer.pt", "worker-1-0.pt"))
        before = {p.name: p.stat().st_mtime_ns for p in remote.iterdir()}
        assert t.mirror.sync()
        after = {p.name: p.stat().st_mtime_ns for p in remote.iterdir()}
        assert sorted(after) == ["outer.pt", "state.pt", "worker-0-0.pt", "worker-1-0.pt"]
        assert all(after[n] == before[n] for n in before)  # the mirror did not upload them again
        # a storage the writers cannot reach (a file:// path under a regular file): the mirror uploads
        blocked = tmp_path / "blocked"
        blocked.write_text("a file, not a directory")
        # the run's checkpointer given another mirror, whose writers are sent where they cannot write
        assert t.checkpointer is not None and t.checkpointer.mirror is t.mirror
        t.checkpointer.mirror = t.mirror = Mirror(t.run_dir, f"file://{tmp_path / 'store2'}")
        t.mirror.checkpoint_uri = lambda name: f"file://{blocked}/{name}"
        caplog.clear()
        t.outer_step(2)
        t.checkpoint()
        assert any("could not upload" in r.getMessage() for r in caplog.records), caplog.text  # a warning
        assert t.mirror.sync()
        stored = tmp_path / "store2" / "up" / "checkpoints" / "step_000002"
        assert sorted(p.name for p in stored.iterdir()) == ["outer.pt", "state.pt", "worker-0-0.pt", "worker-1-0.pt"]
    finally:
        t.shutdown()
