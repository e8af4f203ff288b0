"""Every process of a run takes its threads from its Ray CPU share (``components.threads``), never
from the machine's core count: a run on a Ray node declared with 16 CPUs on this 2-core machine
(its own Ray, in a subprocess), 2 replica workers of 5 CPUs and K = 2 outer shards of 2 CPUs; each
process reports the threads it uses after a 4-bit sync has loaded the codec (numba)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import ray
    sys.path.insert(0, sys.argv[1])
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR")
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.runtime.cluster import all_workers
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config(None, [
        "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.context=16",
        f"data.path={sys.argv[2]}", "data.seq_len=16", "inner.global_batch=4",
        "diloco.replicas=2", "diloco.H=2", "diloco.cpus_per_worker=5", "diloco.outer_shards=2",
        "diloco.outer_cpus=2", "streaming.quantization=fp4_e3m0", "run.steps=4", "run.eval_every=0",
        "run.checkpoint_every=0", f"run.output_dir={tempfile.mkdtemp()}", "tracking.wandb=false",
        "tracking.progress=false"])
    t = Trainer(cfg, new_run_dir(cfg), load_corpus(cfg.data))
    t.start()
    try:
        workers = all_workers(t.replicas)
        for k in (1, 2):  # two outer steps: each process has run the fused codec (numba loaded)
            ray.get([w.train.remote((k - 1) * 2, k * 2) for w in workers])
        reports = ray.get([w.thread_report.remote() for w in workers]) + ray.get(t.driver.thread_reports.remote())
    finally:
        t.shutdown()
    print("REPORTS " + json.dumps(reports))
""")


def test_each_process_takes_its_threads_from_its_ray_cpu_share(tmp_path):
    from helpers import ROOT, SHAKESPEARE

    text = tmp_path / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:20000])
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT), str(text)], capture_output=True, text=True,
                         timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("REPORTS ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    reports = json.loads(line[0].removeprefix("REPORTS "))
    workers, driver, shards = reports[:2], reports[2], reports[3:]
    assert len(shards) == 2 and len({r["pid"] for r in reports}) == 5
    for w in workers:  # cpus_per_worker 5: torch, numba and the children's variables; OpenMP's pool spins
        assert (w["torch_threads"], w["numba_threads"]) == (5, 5), w
        assert w["env"]["OMP_NUM_THREADS"] == w["env"]["MKL_NUM_THREADS"] == w["env"]["NUMBA_NUM_THREADS"] == "5", w
        assert w["env"]["OMP_WAIT_POLICY"] is None, w
    for s in shards:  # outer_cpus 2 each; idle OpenMP threads sleep (set before the process started)
        assert (s["torch_threads"], s["numba_threads"]) == (2, 2), s
        assert s["env"]["OMP_WAIT_POLICY"] == "PASSIVE" and s["env"]["NUMBA_NUM_THREADS"] == "2", s
    assert driver["torch_threads"] == 1 and driver["cpus"] == 0, driver  # K = 2: the driver holds no state
    # the node's 16 CPUs: every process's threads fit in them (5 + 5 + 2 + 2 + 1)
    assert sum(r["torch_threads"] for r in reports) <= 16
    assert sum(max(r["torch_threads"], r["numba_threads"]) for r in reports) <= 16


NO_ROOM = textwrap.dedent("""
    import atexit, sys, time
    import ray
    from ray.cluster_utils import Cluster
    sys.path.insert(0, sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=4)
    atexit.register(lambda: (ray.shutdown(), cluster.shutdown()))
    ray.init(address=cluster.address, logging_level="ERROR")
    from ray_diloco.components.data import load_corpus
    from ray_diloco.config import load_config
    from ray_diloco.errors import ClusterError
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = load_config(None, [f"data.path={sys.argv[2]}", "diloco.cpus_per_worker=1", "diloco.outer_cpus=2",
                             "diloco.placement_timeout_s=3", "run.steps=4", "tracking.wandb=false",
                             "tracking.progress=false", f"run.output_dir={sys.argv[3]}"])
    t = Trainer(cfg, new_run_dir(cfg), load_corpus(cfg.data))
    t0 = time.monotonic()
    try:
        t.start()
        print("STARTED")
    except ClusterError as e:
        print(f"ERROR {time.monotonic() - t0:.1f} {e}")
    finally:
        t.shutdown()
""")


def test_an_outer_side_that_finds_no_room_is_one_line_not_a_hang(tmp_path):
    """The driver reserves ``diloco.outer_cpus`` on the job's node (pinned there): where that node has
    fewer, the cluster's total notwithstanding, the run stops at start with one line naming the
    field, after ``diloco.placement_timeout_s`` (it waited for ever: on a 3-node cluster a replica's
    placement group took the head's CPU first)."""
    from helpers import ROOT, SHAKESPEARE

    text = tmp_path / "text.txt"
    text.write_text(SHAKESPEARE.read_text()[:20000])
    out = subprocess.run([sys.executable, "-c", NO_ROOM, str(ROOT), str(text), str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith(("ERROR ", "STARTED"))]
    assert line and line[0].startswith("ERROR "), out.stdout[-2000:] + out.stderr[-3000:]
    _, seconds, message = line[0].split(" ", 2)
    assert float(seconds) < 60
    assert message.startswith("diloco.outer_cpus = 2: the outer side (the driver on the job's node) found no node")
