"""The sync strategies (runtime/strategy.py) and the resolved run (runtime/resolved.py), without Ray:
the facts each strategy derives from the config, the accounting of one outer step, and that a
run's resolved values never reach the user's config object."""

from __future__ import annotations

import math

import pytest

from ray_diloco.config import load_config
from ray_diloco.core.fragments import ParamSpec, plan_fragments
from ray_diloco.runtime.resolved import ResolvedRun
from ray_diloco.runtime.strategy import DataParallelSync, DiLoCoSync, make_strategy, round_fields, strategy_class


def _metrics(replica, rank, tokens, up=0, down=0):
    return {"replica": replica, "rank": rank, "tokens": tokens,
            "link": {"bytes_up": up, "bytes_down": down, "events": 1, "peak_event_bytes": up + down}}


def test_the_algorithm_picks_the_strategy():
    assert strategy_class(load_config()) is DiLoCoSync
    assert isinstance(make_strategy(load_config(overrides=["algorithm=dp"])), DataParallelSync)


def test_layouts_one_group_per_replica_or_one_ddp_group():
    cfg = load_config(overrides=["diloco.replicas=3", "diloco.workers_per_replica=2", "inner.global_batch=12",
                                 "diloco.max_replicas=4"])
    assert DiLoCoSync.layout(cfg) == [(m, m, 0, 2, "STRICT_PACK") for m in range(3)]
    assert DiLoCoSync.layout(cfg, [(5, 1, 40), (7, 3, 80)]) == [(5, 1, 40, 2, "STRICT_PACK"), (7, 3, 80, 2, "STRICT_PACK")]
    assert DiLoCoSync.workers(cfg) == 8  # every slot of max_replicas: a joiner takes a free one
    dp = load_config(overrides=["algorithm=dp", "diloco.replicas=3", "diloco.workers_per_replica=2",
                                "inner.global_batch=12"])
    assert DataParallelSync.layout(dp) == [(0, 0, 0, 6, "PACK")]
    assert DataParallelSync.workers(dp) == 6 and DataParallelSync.reported_replicas(dp) == 0
    assert DiLoCoSync.link_ranks(cfg) == 3 and DataParallelSync.link_ranks(dp) == 6


def test_allreduce_emulation_only_for_dp_under_a_network():
    assert not DataParallelSync.allreduce_emulation(load_config(overrides=["algorithm=dp"]))
    assert DataParallelSync.allreduce_emulation(load_config(overrides=["algorithm=dp", "network.latency_ms=5"]))
    assert not DiLoCoSync.allreduce_emulation(load_config(overrides=["network.latency_ms=5"]))


def test_round_traffic_counts_the_ranks_on_the_slow_link():
    metrics = [_metrics(0, 0, 100, 10, 20), _metrics(0, 1, 100), _metrics(1, 0, 60, 5, 7)]
    link, tokens = make_strategy(load_config()).round_traffic(metrics, 0, 50)
    assert [(m["replica"], m["rank"]) for m in link] == [(0, 0), (1, 0)] and tokens == 160  # live replicas' own
    dp = load_config(overrides=["algorithm=dp"])
    link, tokens = make_strategy(dp).round_traffic(metrics, 50, 70)
    assert len(link) == 3 and tokens == 20 * dp.inner.global_batch * dp.data.seq_len  # one group, one global batch


def test_round_fields_combine_fragments_and_replicas():
    rounds = [{"fragment": 0, "update_norm": 3.0, "delta_norms": {0: 1.0, 1: 2.0}, "bytes_up": 10, "bytes_down": 4},
              {"fragment": 1, "update_norm": 4.0, "delta_norms": {0: 2.0, 1: 2.0}, "bytes_up": 6, "bytes_down": 2},
              {"fragment": 0, "update_norm": 0.0, "delta_norms": {1: 1.0}, "bytes_up": 1, "bytes_down": 1}]
    f = round_fields(rounds)
    assert f["outer_update_norm"] == pytest.approx(5.0)
    assert f["pseudo_grad_norm"] == pytest.approx({"replica_0": math.sqrt(5), "replica_1": 3.0})
    assert f["fragment_syncs"] == 3 and f["sync_bytes_fragment"] == {"fragment_0": 16, "fragment_1": 8}


def test_headers_and_fragment_checks():
    cfg = load_config(overrides=["diloco.min_replicas=2", "streaming.overlap_steps=20"])
    lines = DiLoCoSync(cfg).header(target=2)
    assert lines[0].startswith("M=2 replicas x 1 worker(s), H=50") and lines[1].startswith("elastic: quorum 2")
    assert lines[2] == "outer optimiser: driver on the job's node, its state in the driver"  # where it runs, said
    sharded = load_config(overrides=["diloco.outer_shards=3", "diloco.driver_resource=outer_host"])
    assert DiLoCoSync(sharded).header(2)[-1] == ("outer optimiser: driver on a node with resource 'outer_host', "
                                                 "3 shards (kept apart from their copies), each copied to the next: on")
    frags = plan_fragments([ParamSpec(f"layers.{i}.w", (10,)) for i in range(9)], 9)
    assert DiLoCoSync(cfg).plan(frags[:3]) and not DiLoCoSync(cfg).plan(frags[:1])  # 20 x 3 >= 50
    s = DiLoCoSync(cfg)
    s.plan(frags[:2])  # the plan sets the schedule and the size the transfer allowances use
    assert s.schedule is not None and s.schedule.num_fragments == 2 and s.num_params == 20
    dp = load_config(overrides=["algorithm=dp"])
    assert DataParallelSync(dp).header(2)[0].startswith("DDP over 2 worker(s)") and not DataParallelSync(dp).plan(frags)


def test_a_resolved_run_never_changes_the_users_config():
    user = load_config(overrides=["run.steps=40"])
    resolved = ResolvedRun.resolve(user, steps=77).with_cpus(0.5)
    run = resolved.apply(user)
    assert (run.run.steps, run.diloco.cpus_per_worker, run.model.family, run.model.n_layers) == (77, 0.5, "gpt2", 4)
    assert (user.run.steps, user.diloco.cpus_per_worker, user.model.family, user.model.n_layers) == (40, None, None, None)
    assert ResolvedRun.resolve(load_config(overrides=["model.n_layers=2"])).model["n_layers"] == 2  # the user's wins


def test_hsdp_ranks_fill_a_node_before_the_next():
    """A shard group is consecutive ranks: PACK may interleave bundles over nodes, the ranks don't."""
    from ray_diloco.runtime.cluster import ranks_by_node

    assert ranks_by_node(["a", "b", "a", "b"]) == [0, 2, 1, 3]  # ranks 0, 1 on node a; 2, 3 on b
    assert ranks_by_node(["b", "a", "a", "b", "c", "a"]) == [0, 3, 1, 2, 5, 4]
    assert ranks_by_node(["n"] * 4) == [0, 1, 2, 3]  # one node: bundle r for rank r


def test_a_resume_compares_the_shard_group_size_it_resolves_to():
    """A run left at the default S may be resumed with that S written out, not with another."""
    from ray_diloco.errors import ConfigError
    from ray_diloco.runtime.launcher import _check_resumable

    base = ["diloco.sharding=hsdp", "diloco.workers_per_replica=8", "inner.global_batch=16"]
    saved = load_config(overrides=base)  # S = 4
    _check_resumable(load_config(overrides=[*base, "diloco.shard_group_size=4"]), saved)
    with pytest.raises(ConfigError) as e:
        _check_resumable(load_config(overrides=[*base, "diloco.shard_group_size=2"]), saved)
    assert e.value.problems == ["diloco.shard_group_size = 2: the checkpoint was trained with 4; it cannot change on resume"]
