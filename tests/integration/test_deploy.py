"""Cluster deployment (issue 5): the launcher configs against Ray's own cluster-config schema,
the KubeRay manifests' fields, and a real `ray start --head` + `ray job submit --working-dir`."""

from __future__ import annotations

import copy
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, alive, pids_with, read_metrics, tiny_overrides

CLUSTERS = ROOT / "clusters"
LAUNCHER = [CLUSTERS / "aws.yaml", CLUSTERS / "gcp.yaml"]
KUBERAY = [CLUSTERS / "kuberay" / "raycluster.yaml", CLUSTERS / "kuberay" / "rayjob.yaml"]


def _validate_launcher(cfg: dict) -> None:
    """What `ray up` does first: fill in the provider's defaults, then check the result against
    Ray's JSON schema for cluster configs (ray/autoscaler/ray-schema.json)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_config_passes_rays_schema_and_has_what_we_rely_on(path):
    import jsonschema

    cfg = yaml.safe_load(path.read_text())
    _validate_launcher(cfg)
    broken = copy.deepcopy(cfg)  # the check can fail: an unknown field and a fractional GPU count
    broken["available_node_types"]["gpu_1x"]["resources"]["GPU"] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        _validate_launcher(broken)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head is a CPU node"
    gpu_types = {n: t for n, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert len({t["resources"]["GPU"] for t in gpu_types.values()}) >= 2, "one node type per replica size"
    assert any(o.startswith("--shm-size=") for o in cfg["docker"]["run_options"])
    assert cfg["file_mounts"] == {"/home/ray/ray_diloco": "."}
    assert any("pip install" in c and "/home/ray/ray_diloco" in c for c in cfg["setup_commands"])
    assert cfg["docker"]["image"].startswith("rayproject/ray:")


def _containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    return [c for g in groups for c in g["template"]["spec"]["containers"]], groups


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifests_have_the_fields_we_rely_on(path):
    """No KubeRay CRD schema ships offline: parse the manifest and check each field we rely on."""
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayCluster", "RayJob")
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    containers, groups = _containers(spec)
    assert len({c["image"] for c in containers}) == 1, "head and workers run the same image"
    for g in groups:  # /dev/shm is a memory-backed volume in every pod
        vols = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        for c in g["template"]["spec"]["containers"]:
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
            assert vols[mount["name"]]["emptyDir"]["medium"] == "Memory"
    for g in spec["workerGroupSpecs"]:
        lim = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(lim["nvidia.com/gpu"]) >= 1
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    dockerfile = (CLUSTERS / "Dockerfile").read_text()
    assert "pip install" in dockerfile and containers[0]["image"].split("/")[-1].split(":")[0] == "ray-diloco"
    if doc["kind"] == "RayJob":  # the entrypoint is a valid command with a valid config
        from ray_diloco.cli import _parser
        from ray_diloco.config import load_config

        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[:2] == ["ray-diloco", "train"]
        a = _parser().parse_args(argv[1:])
        cfg = load_config(a.config, a.overrides)
        gpus = int(spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert cfg.diloco.gpus_per_worker * cfg.diloco.workers_per_replica <= gpus
        assert cfg.diloco.replicas <= sum(g["replicas"] for g in spec["workerGroupSpecs"])
        assert cfg.run.storage_path.startswith(("s3://", "gs://")), "pods are ephemeral: results go to a bucket"
        assert doc["spec"]["shutdownAfterJobFinishes"] is True


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _stop_head(temp_dir: str) -> None:
    """Stop only this test's head. `ray stop` would stop every Ray on the machine, including the
    test session's cluster, so the head's processes are found by their session directory: SIGTERM,
    then SIGKILL for any still alive after 10 s."""
    for pid in pids_with(temp_dir):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while (left := [p for p in pids_with(temp_dir) if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
def test_ray_job_submit_runs_train_on_a_started_head(tmp_path, small_text):
    """`ray start --head` on loopback, `ray job submit --working-dir` of a directory holding a
    tiny config, SUCCEEDED, then the run's checkpoint and metrics are where the config put them."""
    work = tmp_path / "job"
    work.mkdir()
    cfg = tiny_overrides(tmp_path, run__name="job", run__steps=10, data__path="shakespeare.txt",
                         diloco__cpus_per_worker=0.5)
    cfg["run"]["output_dir"] = str(tmp_path / "runs")  # the working dir is a copy that Ray deletes later
    (work / "shakespeare.txt").write_text(small_text.read_text())
    (work / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    temp_dir = tempfile.mkdtemp(prefix="rdjob", dir="/tmp")  # short: Ray's socket paths live under it
    gcs, dash, client, agent, agent_grpc, metrics, rt_env = _free_ports(7)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # Ray 2.60 turns token auth on for `ray start` once ~/.ray/auth_token exists (a local ray.init
    # writes it) but not for the `ray job` client: say it for both, as a user of such a machine must
    env["RAY_AUTH_MODE"] = "token"
    ray_bin = str(Path(sys.executable).parent / "ray")
    try:
        start = subprocess.run(
            [ray_bin, "start", "--head", "--num-cpus=2", "--node-ip-address=127.0.0.1", f"--port={gcs}",
             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
             f"--runtime-env-agent-port={rt_env}", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            capture_output=True, text=True, timeout=180, env=env)
        assert start.returncode == 0, start.stderr[-3000:]
        address = f"http://127.0.0.1:{dash}"
        sub = subprocess.run(
            [ray_bin, "job", "submit", "--address", address, "--working-dir", str(work), "--no-wait",
             "--", "ray-diloco", "train", "--config", "tiny.yaml"],
            capture_output=True, text=True, timeout=180, env=env)
        assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-2000:]
        job_id = next(w.strip("'") for w in sub.stdout.split() if w.strip("'").startswith("raysubmit_"))

        def ray_cli(*args):
            p = subprocess.run([ray_bin, *args, "--address", address], capture_output=True, text=True, timeout=120,
                               env=env)
            assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
            return p.stdout, p.stderr

        deadline = time.monotonic() + float(os.environ.get("JOB_DEADLINE", 300))
        while not any(f"{job_id}' {s}" in (status := "".join(ray_cli("job", "status", job_id)))
                      for s in ("succeeded", "failed", "stopped")):
            assert time.monotonic() < deadline, f"the job did not finish in 300 s: {job_id!r} {status[-1500:]}"
            time.sleep(1)
        logs = ray_cli("job", "logs", job_id)[0]
        assert f"Job '{job_id}' succeeded" in status, status + logs[-3000:]
        assert "final validation loss of the global model" in logs
        run_dir = tmp_path / "runs" / "job"
        assert (run_dir / "checkpoints" / "step_000002" / "state.pt").is_file()
        rows = read_metrics(run_dir)
        assert [r["outer_step"] for r in rows] == [1, 2] and all(r["eval_loss"] > 0 for r in rows)
        assert json.loads((run_dir / "summary.json").read_text())["inner_steps"] == 10
        # it joined the started cluster instead of starting a local one: its actors are in its GCS
        names = [a["class_name"] for a in json.loads(ray_cli("list", "actors", "--format", "json", "--limit", "1000")[0])]
        assert names.count("ReplicaWorker") == 2 and names.count("OuterDriver") == 1, names
    finally:
        _stop_head(temp_dir)
