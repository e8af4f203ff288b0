"""Shared fixtures: one real local Ray for the session, a small real corpus (helpers.py has the rest)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import ROOT, SHAKESPEARE

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the small path's token cache (data.cache_dir): one per test session, not the user's ~/.cache
os.environ.setdefault("RAY_DILOCO_CACHE", __import__("tempfile").mkdtemp(prefix="ray-diloco-test-cache-"))

def pytest_collection_modifyitems(items):
    """The unit layer first (seconds, no Ray), then the integration tests: a whole run shows a broken
    unit at once, and the unit tests run before the session's Ray cluster starts. (``--ff`` puts
    failed tests first afterwards: unit tests after an integration one then fail with a line
    saying so; run ``tests/unit`` on its own.)"""
    items.sort(key=lambda item: 0 if (ROOT / "tests" / "unit") in item.path.parents else 1)


@pytest.fixture(scope="session")
def small_text(tmp_path_factory) -> Path:
    """The first 60k characters of Tiny Shakespeare (real text, quick to tokenise)."""
    p = tmp_path_factory.mktemp("data") / "shakespeare_60k.txt"
    p.write_text(SHAKESPEARE.read_text()[:60000])
    return p


@pytest.fixture(scope="session")
def corpus(small_text):
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import DataConfig

    return load_corpus(DataConfig(path=str(small_text), seq_len=16))


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster (2 CPUs) shared by every test that needs it."""
    import ray

    if not ray.is_initialized():
        # workers inherit this environment (WANDB_MODE above; PYTHONPATH: they import the test models
        # and reference loops from tests/helpers.py); no job runtime_env, so Ray's prestarted workers
        # can host actors
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
        # address="local": a cluster another process started here (`ray start`, a test script's
        # cluster_utils head) is never joined by chance
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The GCS address of the session's Ray cluster: a ``ray-diloco`` process started with
    ``RAY_ADDRESS`` set to it joins that cluster instead of starting its own (6 s on 2 cores)."""
    return ray_session.get_runtime_context().gcs_address




@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 protocol server (moto's) on a free loopback port, started once per test session;
    yields ``host:port``. Tests that need it skip where moto is not installed."""
    import socket
    import subprocess
    import sys
    import time

    pytest.importorskip("moto")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


_BUCKETS = iter(range(1, 1_000_000))


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch):
    """A new, empty bucket on the session's moto server, with the AWS variables a client needs
    set for this test; yields the storage URI ``s3://BUCKET/runs?...`` with pyarrow's endpoint
    options."""
    from ray_diloco.components.storage import filesystem

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    bucket = f"bucket-{next(_BUCKETS)}"
    uri = f"s3://{bucket}/runs?endpoint_override={moto_endpoint}&scheme=http&region=us-east-1"
    fs, _ = filesystem(uri + "&allow_bucket_creation=true")
    fs.create_dir(bucket)
    return uri
