"""The cost of one outer exchange, against a gloo all-reduce of the same bytes (issue 14).

A model whose P parameters are exchanged but cost no compute (one big fp32 tensor that decays
a little at every inner step, outside autograd, so every pseudo-gradient is dense and non-zero;
the loss reads only a vocabulary-sized bias): M replicas x 1 worker, H=2, no emulated link,
``streaming.overlap_steps`` 0 so a replica's training thread waits for the whole exchange at
its sync step. For each (P, M, format, K):

- ``sync_s``: the median seconds a replica's training thread spends in one outer sync (send
  to merge: computing the pseudo-gradient, encoding, the driver's round and outer step, the
  reply, decoding and the merge; ``ReplicaWorker.train``'s ``sync_s``), first outer step left
  out (start-up);
- ``round_sync_s`` (``round`` in the table): what a run reports for the same syncs: the median
  over the outer steps after the first of the step's wall time less the workers' mean compute
  seconds (a training run's ``round_s - inner_compute_s``); it also holds the Ray calls that start
  each outer step and, when the replicas compute unevenly, the wait for the slower one;
- ``--model PRESET [--layers N] [--H 10]``: a real training run of that preset (``90m`` with 14
  layers: 99M parameters) instead of the model that costs no compute, one 32-token sequence per
  replica and inner step, so a row is exactly what a run pays per sync (``round``) beside the
  exchange's own share (``sync_s``);
- ``--compute-s S``: each inner step also computes: as many matrix products on the worker's
  threads as take S seconds when the worker starts (a fixed amount of work, slower when the cores
  are shared, as a training step's), so the replicas' cores are busy between syncs as a training
  run's are (with ``--step-s`` they sleep);
- ``allreduce_s``: the median seconds of a gloo all-reduce (sum) of the same fp32 ``[P]``
  tensor among M processes, measured in the same run; ``ratio`` = ``sync_s / allreduce_s``;
- ``memcpy_s``: one copy of ``[P]`` fp32 in this process;
- ``sync_gb_s``: the bytes a replica moves in one sync (up + down) / ``sync_s``;
- ``outer_shards``: ``diloco.outer_shards`` K (K = 1: the driver holds the global parameters;
  K > 1: K shard actors do, the driver only decides the rounds);
- ``outer_peak_rss_u``, ``worker_peak_rss_u``: the peak resident memory (``VmHWM`` from /proc)
  of the outer-optimiser side (the driver and its K shard actors, summed) and of the largest
  replica worker, in units of U = 4 P bytes
  (one fp32 copy of the model). Resident memory counts the object-store pages a process has
  mapped (the pseudo-gradients the actor read, the replies it wrote), which the object store
  owns and frees; so each is split, sampled every 50 ms, into ``*_private_u`` (``RssAnon``:
  the process's own memory) and ``*_shmem_u`` (``RssShmem``: object-store pages mapped);
  ``outer_max_private_u``: the largest one process of the outer side;
  ``job_private_u``: the job's process (the trainer);
- ``--cpus C``: the CPUs each process of the run reserves, so its threads
  (``components.threads``): ``diloco.cpus_per_worker`` C and, with K = 1, ``diloco.outer_cpus`` C
  (K > 1 shards reserve none: one thread each); default this machine's cores shared by the M
  replicas and the outer side (1 on 2 cores with M = 2, 5 on 16); the gloo all-reduce's processes
  get as many torch threads (gloo itself uses none of them) (``cpus_per_process`` in each row);
- ``--step-s S``: each inner step also sleeps S seconds (0: the exchange is all there is, its worst
  case; with S > 0 work done in the background between syncs, e.g. the shards' copies, is hidden
  as real compute hides it);
- ``--nodes N`` (default 1: one local Ray node): a multi-node Ray cluster on this machine
  (``ray.cluster_utils.Cluster``): a head for the job and the outer side (``--cpus`` CPUs: the driver
  is pinned to the job's node; K > 1 shards go to the replicas' nodes), and N - 1 nodes for the
  replicas, each with its own raylet and object store, so pseudo-gradients and replies cross the
  object manager between stores as on a real cluster (``nodes`` in each row);
- ``--store warm`` (default): every node's object store is preallocated
  (``RAY_preallocate_plasma_memory=1``: its shared-memory pages are faulted in when the node
  starts), as a long run's store is after its first outer steps; with ``--store cold`` the syncs
  measured also pay the first touch of the pages each new object lands on (at 100M about 2.4 s
  per sync for the first few, a second now and then after: ``benchmarks/sync_profile.py``'s
  ``put_cold``), which flattered the formats that put fewer bytes (``store`` in each row);
- ``copy_u``: with K > 1 and ``diloco.outer_shard_backup`` on (``--backup on off`` measures both),
  the bytes of the copies the shards keep of each other's state (``runtime.outer_shards``), in U;
  each outer step sends as many bytes between the shards;
- ``run_extra_u``: the peak over the run of the private memory of every process of the run
  (this one, the outer-optimiser actor, the workers; ``RssAnon``, sampled every 50 ms) plus the
  object store's bytes in use, minus the same figure for a run with P = 1000 and the same M and
  K (the processes' own start-up memory), in U.

    python benchmarks/exchange.py [--params 1e6 1e7 1e8] [--replicas 2 4] [--formats none fp4_e3m0]
                                  [--shards 1 2] [--backup on off] [--step-s 0] [--outer-steps 4]
                                  [--nodes 1] [--store warm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _products(n: int) -> None:
    a = torch.full((256, 256), 1 / 256)
    for _ in range(n):
        a = torch.mm(a, a)


def _calibrate(seconds: float) -> int:
    """How many of :func:`_products`' 256 x 256 matrix products take ``seconds`` in this process."""
    n, t0 = 50, time.perf_counter()
    _products(n)
    per = (time.perf_counter() - t0) / n
    return max(1, round(seconds / per))


class BigModel(torch.nn.Module):
    """``w``: ``[P]`` fp32 that every forward scales by 0.9999 outside autograd (so it gets no
    gradient and no AdamW state, yet changes); logits: a ``[vocab]`` bias for every position."""

    def __init__(self, params: int, vocab_size: int, step_s: float = 0.0, compute_s: float = 0.0):
        super().__init__()
        self.step_s = step_s  # seconds of "compute" per forward (slept: the cores stay free)
        # real compute per forward: a fixed number of matrix products on the worker's threads, as
        # many as take compute_s seconds here and now (a fixed amount of work, like a training step:
        # slower when the cores are shared)
        self.products = _calibrate(compute_s) if compute_s else 0
        self.w = torch.nn.Parameter(torch.empty(params).normal_(0.0, 0.02))  # in place: no temporary
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.w.mul_(0.9999)
        if self.step_s:
            time.sleep(self.step_s)
        if self.products:  # the cores busy as a training replica's are
            _products(self.products)
        b, t = input_ids.shape
        return self.bias.view(1, 1, -1).expand(b, t, -1).contiguous()


class BigModelFn:
    """A picklable ``model_fn`` building :class:`BigModel` with ``params`` values."""

    def __init__(self, params: int, step_s: float = 0.0, compute_s: float = 0.0):
        self.params, self.step_s, self.compute_s = params, step_s, compute_s

    def __call__(self, shape: dict, vocab_size: int) -> torch.nn.Module:
        return BigModel(self.params, vocab_size, self.step_s, self.compute_s)


# -- /proc ------------------------------------------------------------------------------------
def _status(pid: int, key: str) -> int:
    """A ``kB`` field of /proc/PID/status in bytes (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _store_bytes() -> int:
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return int(get_memory_info_reply(state).store_stats.object_store_bytes_used)


class Sampler:
    """Samples ``sum(RssAnon of pids) + object store bytes in use`` every ``every`` seconds and
    keeps the peak; also each process's peak private (``RssAnon``) and peak mapped object-store
    (``RssShmem``) memory."""

    def __init__(self, pids: list[int], every: float = 0.05):
        self.pids, self.every, self.peak = pids, every, 0
        self.private = {p: 0 for p in pids}
        self.shmem = {p: 0 for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        store = 0
        while not self._stop.is_set():
            if n % 4 == 0:  # the store figure asks the raylet: every 0.2 s
                try:
                    store = _store_bytes()
                except Exception:
                    pass
            n += 1
            anon = {p: _status(p, "RssAnon") for p in self.pids}
            for p in self.pids:
                self.private[p] = max(self.private[p], anon[p])
                self.shmem[p] = max(self.shmem[p], _status(p, "RssShmem"))
            self.peak = max(self.peak, sum(anon.values()) + store)
            self._stop.wait(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# -- the run ------------------------------------------------------------------------------------
def _config(params: int, replicas: int, fmt: str, outer_steps: int, out_dir: str, shards: int = 1,
            backup: bool = True, cpus: float = 1, model: dict | None = None, H: int = 2):
    from ray_diloco.config import load_config

    tiny = {"preset": "tiny", "n_layers": 1, "n_heads": 1, "d_model": 8, "d_ff": 8, "context": 16}
    return load_config({
        "model": model or tiny,  # a real model (--model): one sequence of 32 tokens per replica and step
        "data": {"path": str(ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"), "seq_len": 32 if model else 16},
        "inner": {"global_batch": replicas if model else 4, "warmup_steps": 1},
        "diloco": {"replicas": replicas, "H": H, "cpus_per_worker": cpus,
                   "outer_cpus": cpus if shards == 1 else 0, "sync_timeout_s": 1800.0,
                   "outer_shards": shards, "outer_shard_backup": backup},
        "streaming": {"quantization": fmt},
        "run": {"steps": H * outer_steps, "eval_every": 0, "checkpoint_every": 0, "log_hashes": False,
                "output_dir": out_dir, "name": f"p{params}-m{replicas}-{fmt}-k{shards}-b{int(backup)}"},
        "tracking": {"wandb": False, "progress": False},
    })


def measure_sync(params: int, replicas: int, fmt: str, outer_steps: int, corpus, out_dir: str,
                 shards: int = 1, backup: bool = True, step_s: float = 0.0, on_step=None, cpus: float = 1,
                 compute_s: float = 0.0, model: dict | None = None, H: int = 2) -> dict:
    """One run of ``outer_steps`` outer steps; the sync figures and peak memories. ``on_step(k)``,
    when given, is called before outer step k (1-based) and with ``outer_steps + 1`` after the last."""
    import ray

    from ray_diloco.runtime.cluster import all_workers
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    cfg = _config(params, replicas, fmt, outer_steps, out_dir, shards, backup, cpus, model, H)
    t = Trainer(cfg, new_run_dir(cfg), corpus, None if model else BigModelFn(params, step_s, compute_s))
    t.start()
    try:
        workers = all_workers(t.replicas)
        outer_pids = ray.get(t.driver.outer_pids.remote())  # the driver, then its shard actors
        worker_pids = ray.get([w.pid.remote() for w in workers])
        sampler = Sampler([os.getpid(), *outer_pids, *worker_pids])
        syncs, moved, rounds = [], [], []
        for k in range(1, outer_steps + 1):
            start, end = (k - 1) * cfg.diloco.H, k * cfg.diloco.H
            if on_step is not None:
                on_step(k)
            t0 = time.perf_counter()
            metrics = ray.get([w.train.remote(start, end) for w in workers])
            wall = time.perf_counter() - t0
            if k > 1:
                syncs += [m["sync_s"] for m in metrics]
                # a run's own figure: the outer step's wall time less the workers' mean compute
                rounds.append(wall - statistics.mean(m["compute_s"] for m in metrics))
                moved += [m["link"]["bytes_up"] + m["link"]["bytes_down"] for m in metrics]
        if on_step is not None:
            on_step(outer_steps + 1)
        peak_total = sampler.stop()
        copies = ray.get(t.driver.memory.remote())["backup_bytes"]
        outer_hwm = sum(_status(p, "VmHWM") for p in outer_pids)
        worker_hwm = max(_status(p, "VmHWM") for p in worker_pids)
    finally:
        t.shutdown()
    sync_s = statistics.median(syncs)
    return {"sync_s": sync_s, "sync_s_all": syncs, "round_sync_s": statistics.median(rounds), "bytes_per_sync": int(statistics.median(moved)),
            "outer_peak_rss": outer_hwm, "copy_bytes": copies, "worker_peak_rss": worker_hwm, "run_peak_total": peak_total,
            "outer_private": sum(sampler.private[p] for p in outer_pids),
            "outer_shmem": sum(sampler.shmem[p] for p in outer_pids),
            "outer_max_private": max(sampler.private[p] for p in outer_pids),
            "worker_private": max(sampler.private[p] for p in worker_pids),
            "worker_shmem": max(sampler.shmem[p] for p in worker_pids), "job_private": sampler.private[os.getpid()]}


def _allreduce_proc(rank: int, world: int, port: int, params: int, reps: int, out, threads: int = 1) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.randn(params)
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 0:
        out.put(statistics.median(times[1:]))


def measure_allreduce(params: int, world: int, reps: int = 5, threads: int = 1) -> float:
    """Median seconds of a gloo all-reduce of fp32 ``[params]`` among ``world`` processes (each
    with ``threads`` torch threads, as a replica worker's share)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_proc, args=(r, world, port, params, reps, out, threads))
             for r in range(world)]
    for p in procs:
        p.start()
    value = out.get(timeout=900)
    for p in procs:
        p.join()
    return value


def measure_memcpy(params: int, reps: int = 5) -> float:
    src = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7, 1e8])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--formats", nargs="+", default=["none", "fp4_e3m0"])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2], help="diloco.outer_shards K values")
    ap.add_argument("--outer-steps", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.0,
                    help="seconds each inner step sleeps (compute the exchange's background work can hide behind)")
    ap.add_argument("--compute-s", type=float, default=0.0,
                    help="seconds each inner step computes (matrix products on the worker's threads: its cores busy "
                         "as a training replica's)")
    ap.add_argument("--model", default=None,
                    help="train this preset instead of the model that costs no compute (a real run: its parameters "
                         "are P; one 32-token sequence per replica and inner step)")
    ap.add_argument("--layers", type=int, default=None, help="--model's model.n_layers (e.g. 90m with 14: 99M)")
    ap.add_argument("--H", type=int, default=10, help="--model's diloco.H (the model that costs no compute: 2)")
    ap.add_argument("--backup", choices=("on", "off"), nargs="+", default=["on"],
                    help="diloco.outer_shard_backup (K > 1): the shards' copies of each other's state")
    ap.add_argument("--skip", nargs="*", default=[], help="P:M pairs to leave out (memory), e.g. 1e8:4")
    ap.add_argument("--nodes", type=int, default=1,
                    help="Ray nodes: 1 (local), or a head without CPUs + N - 1 replica nodes (ray.cluster_utils.Cluster)")
    ap.add_argument("--store", choices=("warm", "cold"), default="warm",
                    help="warm: every node's object store preallocated (its pages faulted in at start, as a long "
                         "run's are after its first outer steps); cold: the syncs measured pay the first touches")
    ap.add_argument("--cpus", type=float, default=None,
                    help="CPUs each process of the run reserves (diloco.cpus_per_worker and diloco.outer_cpus: "
                         "its threads); default: this machine's cores shared by the M replicas and the outer side, "
                         "at least 1")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    cpus = args.cpus or float(max(1, (os.cpu_count() or 1) // (max(args.replicas) + 1)))
    if args.store == "warm":  # read by every raylet this process starts (the local one, or the Cluster's)
        os.environ["RAY_preallocate_plasma_memory"] = "1"

    import ray

    from ray_diloco.components.data import load_corpus

    cluster = None
    store = int(min(6e9, max(1e9, 8 * 4 * max(args.params))))  # per node: a few messages of the largest P
    if args.nodes > 1:  # every node its own raylet and object store: transfers cross the object manager
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "object_store_memory": store})
        per_node = -(-max(args.replicas) // (args.nodes - 1))
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=per_node * cpus, object_store_memory=store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
    else:
        ray.init(address="local", num_cpus=(max(args.replicas) + 1) * cpus, object_store_memory=store,
                 include_dashboard=False,
                 logging_level="ERROR")
    cfg0 = _config(1000, 2, "none", 2, "/tmp")
    corpus = load_corpus(cfg0.data)
    skip = {(int(float(p)), int(m)) for p, m in (s.split(":") for s in args.skip)}
    rows = []
    out_dir = tempfile.mkdtemp(prefix="exchange-bench-")
    base = {(m, k): measure_sync(1000, m, "none", 2, corpus, out_dir, k, cpus=cpus)["run_peak_total"]
            for m in args.replicas for k in args.shards}
    print(f"{'P':>6} {'M':>2} {'format':>9} {'K':>2} {'sync_s':>8} {'round':>7} {'allreduce_s':>11} {'ratio':>6} {'memcpy_s':>8} "
          f"{'GB/s':>6} {'outer_U':>7} {'(priv)':>6} {'worker_U':>8} {'(priv)':>6} {'extra_U':>7} {'copy_U':>6}", flush=True)
    model = None
    if args.model:  # a real model: its parameters are P
        from ray_diloco.models.transformer import build_model, count_parameters

        model = {"preset": args.model, **({"n_layers": args.layers} if args.layers else {})}
        mcfg = _config(1000, 2, "none", 2, "/tmp", model=model)
        with torch.device("meta"):
            args.params = [count_parameters(build_model(mcfg, corpus.vocab_size))]
    for p in (int(x) for x in args.params):
        U = 4 * p
        memcpy_s = measure_memcpy(p)
        for m in args.replicas:
            if (p, m) in skip:
                continue
            allreduce_s = measure_allreduce(p, m, threads=max(1, int(cpus)))
            for fmt, k, b in ((f, k, b) for f in args.formats for k in args.shards for b in args.backup):
                if k == 1 and b == "off" and "on" in args.backup:
                    continue  # K = 1 keeps no copies: the same run
                r = measure_sync(p, m, fmt, args.outer_steps, corpus, out_dir, k, b == "on", args.step_s, cpus=cpus,
                                 compute_s=args.compute_s, model=model, H=args.H if model else 2)
                row = {"params": p, "replicas": m, "nodes": args.nodes, "cpus_per_process": cpus, "store": args.store, "format": fmt, "outer_shards": k, "backup": b == "on" and k > 1,
                       "copy_u": r["copy_bytes"] / U, "sync_s": r["sync_s"], "round_sync_s": r["round_sync_s"],
                       "compute_s": args.compute_s, "model": args.model, "H": args.H if model else 2,
                       "allreduce_s": allreduce_s, "ratio": r["sync_s"] / allreduce_s, "memcpy_s": memcpy_s,
                       "sync_gb_s": r["bytes_per_sync"] / r["sync_s"] / 1e9,
                       "bytes_per_sync": r["bytes_per_sync"], "sync_s_all": r["sync_s_all"],
                       "outer_peak_rss_u": r["outer_peak_rss"] / U, "worker_peak_rss_u": r["worker_peak_rss"] / U,
                       "outer_private_u": r["outer_private"] / U, "outer_shmem_u": r["outer_shmem"] / U,
                       "outer_max_private_u": r["outer_max_private"] / U,
                       "worker_private_u": r["worker_private"] / U, "worker_shmem_u": r["worker_shmem"] / U,
                       "job_private_u": r["job_private"] / U,
                       "run_extra_u": (r["run_peak_total"] - base[(m, k)]) / U,
                       "load_avg_1m": os.getloadavg()[0]}
                rows.append(row)
                print(f"{p / 1e6:>5g}M {m:>2} {fmt:>9} {k:>2} {row['sync_s']:>8.3f} {row['round_sync_s']:>7.3f} {allreduce_s:>11.3f} {row['ratio']:>6.1f} "
                      f"{memcpy_s:>8.3f} {row['sync_gb_s']:>6.2f} {row['outer_peak_rss_u']:>7.1f} "
                      f"{row['outer_private_u']:>6.1f} {row['worker_peak_rss_u']:>8.1f} {row['worker_private_u']:>6.1f} "
                      f"{row['run_extra_u']:>7.1f} {row['copy_u']:>6.1f}   (load {row['load_avg_1m']:.1f})",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


if __name__ == "__main__":
    main()
