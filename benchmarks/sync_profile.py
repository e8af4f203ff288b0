"""The steps of one outer sync (fp32 and fp4), each timed alone, against a memcpy and a gloo all-reduce of
the same fp32 tensor in the same run (issue 27: where a sync's time goes).

``benchmarks/exchange.py`` times whole syncs (``sync_s``); this script times the steps on their
critical path with ``diloco.outer_shards`` K = 1, one node, calling the functions a run calls, on
P fp32 values, for ``streaming.quantization`` ``none`` (fp32) and ``fp4_e3m0`` with error feedback
(``fp4`` columns: the same steps on the wire's bytes):

- ``pseudo_gradient``: ``core.fragments.pseudo_gradient`` (global - local) into a reused buffer,
  one torch thread (a replica worker's ``cpus_per_worker`` 1);
- ``encode`` (fp4): ``core.quantize.encode_message`` with the residual in and the new residual
  out (the fused codec), one thread;
- ``uplink_put``: ``ray.put`` of the pseudo-gradient (the values copied into the object store;
  the object freed before the next repeat, as a run frees it once summed); the store is
  preallocated (``RAY_preallocate_plasma_memory=1``: its pages faulted in at start, as a long
  run's are after its first outer steps; ``benchmarks/exchange.py --store``);
- ``check``: ``core.outer.finite_norm`` (fp4: ``core.codec.norm`` of the bytes) of one arriving
  pseudo-gradient (the outer side reads
  each one before the round can close; M of them, on its check threads);
- ``outer_step``: the mean of M pseudo-gradients and the Nesterov step in one chunked pass
  (``core.outer.OrderedMean`` + ``OuterOptimizer.step_ordered``; fp4: the terms decoded a chunk
  at a time and the update encoded, applied and its residual kept per chunk,
  ``core.wire.Downlink.step``), with the outer side's threads (``--outer-cpus``: ``components.threads.thread_plan``);
- ``reply_put``: ``ray.put`` of the new global fragment (the reply every replica reads);
- ``merge``: ``core.fragments.unflatten_into`` of the new global into the parameters, one thread
  (fp4: after ``core.wire.apply_downlink`` decoded the reply onto the old global);
- ``critical_path_s``: the sum, M x check counted / threads: a lower bound of one sync (no Ray call latency, no scheduling: the M replicas' puts
  and the outer side share this machine's cores in a real run);
- ``allreduce_s``: a gloo all-reduce (sum) of fp32 ``[P]`` among M processes
  (``benchmarks/exchange.py``'s); every figure also as a ratio to it (``*_ar``) and to a memcpy
  (``*_x``).

Each figure is the median of ``--repeats`` runs after one warm-up.

    python benchmarks/sync_profile.py [--params 1e8] [--replicas 2] [--repeats 3] [--json PATH]

``--in-run FORMAT`` profiles the syncs of a real run instead (``benchmarks/exchange.py``'s run: M
replica actors, the outer driver, the object store, each process with the threads a run gives
it): every process of the run is sampled (``benchmarks/stack_sampler.py``: each Python thread's
stack every 10 ms, each OS thread's CPU seconds) over the outer steps after the first, and the
table gives, per process, the wall seconds of the window, where its Python threads were (the
top frames, in seconds), and the CPU seconds of its threads that run Python and of those that
do not (OpenMP and numba pools, Ray's own threads), with the thread settings each process saw.
Environment variables given with ``--env NAME=VALUE`` reach every process of the run (the
raylet it starts passes them on).

    python benchmarks/sync_profile.py --in-run fp4_e3m0 [--params 1e8] [--outer-steps 4] [--env OMP_WAIT_POLICY=PASSIVE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codec import timed as codec_timed  # noqa: E402
from exchange import measure_allreduce  # noqa: E402


def timed(fn, repeats: int, threads: int, warmup: int = 1) -> float:
    """``benchmarks/codec.py``'s median with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    return codec_timed(fn, repeats, warmup)


def profile(params: int, replicas: int, repeats: int, outer_cpus: float = 1) -> dict:
    import ray

    from ray_diloco.components.threads import thread_plan
    from ray_diloco.config.schema import OuterConfig
    from ray_diloco.core.fragments import Fragment, ParamSpec, pseudo_gradient, unflatten_into
    from ray_diloco.core.outer import OrderedMean, OuterOptimizer, finite_norm
    from ray_diloco.core.quantize import encode_message, fused_codec
    from ray_diloco.core.wire import Downlink, apply_downlink

    rng = np.random.default_rng(0)
    glob = torch.from_numpy(rng.standard_normal(params, dtype=np.float32))
    local = {"w": glob + torch.from_numpy(rng.standard_normal(params, dtype=np.float32)) * 0.01}
    frag = Fragment(0, (ParamSpec("w", (params,)),))
    buf = torch.empty(params)
    outer_threads = thread_plan("outer side", outer_cpus).intra_op
    os.environ["RAY_preallocate_plasma_memory"] = "1"
    store = int(min(6e9, max(1e9, 8 * 4 * params)))  # as benchmarks/exchange.py's
    ray.init(address="local", num_cpus=2, object_store_memory=store, include_dashboard=False, logging_level="ERROR")
    try:
        pg = pseudo_gradient(glob, local, frag, out=buf).numpy()
        terms = [pg * (1 + 0.1 * i) for i in range(replicas)]
        opt = OuterOptimizer([glob.numpy().copy()], OuterConfig())

        def put() -> None:
            ref = ray.put(pg)
            del ref

        def step() -> None:
            mean = OrderedMean(params)
            for t in terms:
                mean.add(t, 1.0)
            opt.step_ordered(0, mean)

        new_global = opt.fragments[0].param
        memcpy_dst = np.empty_like(pg)
        r = {
            "memcpy": timed(lambda: np.copyto(memcpy_dst, pg), repeats, 1),
            "pseudo_gradient": timed(lambda: pseudo_gradient(glob, local, frag, out=buf), repeats, 1),
            "uplink_put": timed(put, repeats, 1, warmup=2),
            "check": timed(lambda: finite_norm(terms[0]), repeats, 1),
            "outer_step": timed(step, repeats, outer_threads),
            "reply_put": timed(lambda: ray.put(new_global.numpy()), repeats, outer_threads, warmup=2),
            "merge": timed(lambda: unflatten_into(local, frag, new_global), repeats, 1),
        }
        # fp4 with error feedback: the same steps on the wire's bytes
        fmt, codec = "fp4_e3m0", fused_codec()
        delta = torch.from_numpy(pg)
        residual, new_residual = torch.zeros(params), torch.empty(params)
        msgs = [encode_message(torch.from_numpy(t), fmt, residual, new_residual) for t in terms]
        packed = [_unpack(m) for m in msgs]
        opt4, down = OuterOptimizer([glob.numpy().copy()], OuterConfig()), Downlink(fmt, True)

        def step4() -> None:
            mean = OrderedMean(params)
            for pk in packed:
                mean.add(pk, 1.0)
            step4.reply = down.step(opt4, 0, mean)[0]

        step4()
        out = torch.empty(params)

        def merge4() -> None:
            apply_downlink(glob, step4.reply, out=out)
            unflatten_into(local, frag, out)

        r4 = {
            "pseudo_gradient": r["pseudo_gradient"],
            "encode": timed(lambda: encode_message(delta, fmt, residual, new_residual), repeats, 1),
            "uplink_put": timed(lambda: ray.put(msgs[0]), repeats, 1, warmup=2),
            "check": timed(lambda: codec.norm(packed[0].payload, packed[0].scales, fmt, params), repeats, 1),
            "outer_step": timed(step4, repeats, outer_threads),
            "reply_put": timed(lambda: ray.put(step4.reply), repeats, outer_threads, warmup=2),
            "merge": timed(merge4, repeats, 1),
        }
    finally:
        ray.shutdown()
    for d in (r, r4):
        d["critical_path"] = sum(v for k, v in d.items() if k not in ("memcpy", "check"))
        d["critical_path"] += replicas * d["check"] / outer_threads
    allreduce = measure_allreduce(params, replicas)
    row = {"params": params, "replicas": replicas, "outer_threads": outer_threads, "allreduce_s": allreduce}
    for prefix, d in (("", r), ("fp4_", r4)):
        for k, v in d.items():
            row[f"{prefix}{k}_s"] = v
            row[f"{prefix}{k}_x"] = v / r["memcpy"]
            row[f"{prefix}{k}_ar"] = v / allreduce
    return row


def _unpack(message):
    """A message's ``Packed`` view (what the outer side sums)."""
    from ray_diloco.core.formats import parse as from_message

    return from_message(message)


def in_run(params: int, replicas: int, fmt: str, outer_steps: int, env: list[str], top: int = 8) -> dict:
    """Profile the syncs of ``benchmarks/exchange.py``'s run (see the module docstring)."""
    import tempfile
    import time

    import ray
    import stack_sampler
    from exchange import _config, measure_sync

    from ray_diloco.components.data import load_corpus

    for kv in env:
        k, _, v = kv.partition("=")
        os.environ[k] = v
    folder = tempfile.mkdtemp(prefix="stacks-")
    here = str(Path(__file__).resolve().parent)
    os.environ["RAY_DILOCO_STACKS"] = folder
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["RAY_preallocate_plasma_memory"] = "1"
    stack_sampler.start()
    store = int(min(6e9, max(1e9, 8 * 4 * params)))
    ray.init(address="local", num_cpus=replicas + 1, object_store_memory=store, include_dashboard=False,
             logging_level="ERROR", runtime_env={"worker_process_setup_hook": "stack_sampler.start"})
    on = os.path.join(folder, "ON")

    def window(k: int) -> None:  # sample outer steps 2.. (the first pays start-up)
        if k == 2:
            open(on, "w").close()
        elif k == outer_steps + 1 and os.path.exists(on):
            os.remove(on)
            time.sleep(1.5)  # every sampler writes its closed window

    try:
        corpus = load_corpus(_config(1000, 2, "none", 2, "/tmp").data)
        r = measure_sync(params, replicas, fmt, outer_steps, corpus, tempfile.mkdtemp(prefix="sync-prof-"),
                         on_step=window)
    finally:
        ray.shutdown()
    procs = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        doc = json.load(open(os.path.join(folder, name)))
        if not doc["counts"]:
            continue
        every, wall = doc["every_s"], doc["window_s"]
        frames = [(label, n * every, thread) for thread, c in doc["counts"].items() for label, n in c.items()]
        frames.sort(key=lambda x: -x[1])
        py_threads = set(doc["counts"])
        cpu = doc["thread_cpu_s"]
        py_cpu = sum(v for k, v in cpu.items() if k.split(":", 1)[1] in py_threads)
        procs.append({"title": doc["title"], "pid": doc["pid"], "window_s": wall, "settings": doc["settings"],
                      "cpu_s": sum(cpu.values()), "threads": len(cpu),
                      "busiest_threads": sorted(cpu.items(), key=lambda x: -x[1])[:top],
                      "python_thread_cpu_s": py_cpu, "top_frames": frames[:top]})
    return {"params": params, "replicas": replicas, "format": fmt, "env": env, "sync_s": r["sync_s"],
            "sync_s_all": r["sync_s_all"], "processes": procs, "load_avg_1m": os.getloadavg()[0]}


def print_in_run(res: dict) -> None:
    print(f"{res['params'] / 1e6:g}M, M={res['replicas']}, {res['format']}, env {res['env'] or '-'}: "
          f"sync {res['sync_s']:.3f} s (all {', '.join(f'{x:.2f}' for x in res['sync_s_all'])}), "
          f"load {res['load_avg_1m']:.1f}")
    for p in res["processes"]:
        print(f"\n{p['title']} (pid {p['pid']}): window {p['window_s']:.1f} s, CPU {p['cpu_s']:.1f} s in "
              f"{p['threads']} threads; settings {p['settings']}")
        print("  busiest threads: " + ", ".join(f"{k} {v:.1f}s" for k, v in p["busiest_threads"]))
        for label, sec, thread in p["top_frames"]:
            print(f"  {sec:7.2f} s  [{thread}] {label}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-run", default=None, metavar="FORMAT",
                    help="profile a real run's syncs in this streaming.quantization format instead")
    ap.add_argument("--outer-steps", type=int, default=4, help="--in-run: outer steps (the first is not sampled)")
    ap.add_argument("--env", nargs="*", default=[], help="--in-run: NAME=VALUE for every process of the run")
    ap.add_argument("--outer-cpus", type=float, default=1, help="diloco.outer_cpus: the outer side's threads")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.in_run:
        res = in_run(int(a.params), a.replicas, a.in_run, a.outer_steps, a.env)
        print_in_run(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    row = profile(int(a.params), a.replicas, a.repeats, a.outer_cpus)
    print(f"{row['params'] / 1e6:.0f}M fp32 values, M={row['replicas']}, outer-side threads {row['outer_threads']}; "
          f"gloo all-reduce {row['allreduce_s']:.3f} s")
    print(f"{'step':18} {'fp32 s':>8} {'x memcpy':>9} {'x all-reduce':>13} {'fp4 s':>8} {'x memcpy':>9} {'x all-reduce':>13}")
    for k in ("memcpy", "pseudo_gradient", "encode", "uplink_put", "check", "outer_step", "reply_put",
              "merge", "critical_path"):
        a32 = (f"{row[k + '_s']:>8.3f} {row[k + '_x']:>8.1f}x {row[k + '_ar']:>12.2f}x" if k + "_s" in row
               else f"{'-':>8} {'':>9} {'':>13}")
        a4 = (f"{row['fp4_' + k + '_s']:>8.3f} {row['fp4_' + k + '_x']:>8.1f}x {row['fp4_' + k + '_ar']:>12.2f}x"
              if "fp4_" + k + "_s" in row else "")
        print(f"{k:18} {a32} {a4}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
