"""DiLoCo on a real local Ray: identity, parameter identity, exchange of odd shapes, DDP, DP, export.

The plain-AdamW identity (llama), bf16 (qwen3) and export (gpt2, the `tiny` default) tests train
the transformers families; the others the
pure-torch ``conftest.TorchLM`` (no transformers import in their actors) or odd custom shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import odd_model_fn, read_metrics, start_trainer, tiny_overrides, torch_lm, tree

from ray_diloco.components.checkpoint import load_checkpoint
from ray_diloco.components.data import ShardReader, val_windows
from ray_diloco.components.evaluate import evaluate_loss
from ray_diloco.config import load_config
from ray_diloco.core.formats import RAW
from ray_diloco.core.fragments import flatten, param_specs, plan_fragments
from ray_diloco.core.schedules import inner_lr
from ray_diloco.models.transformer import build_model, lm_loss, logits_of, make_inner_optimizer
from ray_diloco.runtime.evaluation import evaluate_on_cluster, evaluate_run_on_cluster
from ray_diloco.runtime.launcher import train


def test_m1_lr1_mu0_is_plain_adamw(ray_session, tmp_path, corpus):
    """M=1, outer SGD lr 1, momentum 0: the global parameters after every outer step equal the
    replica's local parameters, and equal a plain single-process AdamW loop on the same batches."""
    cfg = load_config(tiny_overrides(tmp_path, diloco__replicas=1, diloco__H=4, run__steps=12,
                                     outer__name="sgd", outer__lr=1.0, outer__momentum=0.0, model__family="llama"))
    t = start_trainer(cfg, corpus)
    try:
        # the plain loop: same init, same shard, same AdamW, same lr schedule, same clipping
        model = build_model(cfg, corpus.vocab_size)
        opt = make_inner_optimizer(model, cfg)
        reader = ShardReader(corpus.train, cfg.data.seq_len, 0, 1, cfg.run.seed)
        (frag,) = plan_fragments(param_specs(model), 1)
        import ray

        for k in (1, 2, 3):
            t.outer_step(k)
            for step in range((k - 1) * 4, k * 4):
                for g in opt.param_groups:
                    g["lr"] = inner_lr(step, cfg.inner.lr, cfg.inner.warmup_steps, cfg.run.steps, cfg.inner.min_lr_ratio)
                x, y, _ = reader.next_batch(cfg.batch_per_worker)
                loss, _ = lm_loss(logits_of(model(x)), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
                opt.step()
                opt.zero_grad()
            (glob,) = ray.get(t.driver.global_params.remote())
            local = ray.get(t.replicas[0].rank0.local_fragment.remote(0))
            plain = flatten(dict(model.named_parameters()), frag).numpy()
            # global - (global - local) equals local up to one rounding of the subtraction
            np.testing.assert_allclose(glob, local, rtol=0, atol=1e-6)
            np.testing.assert_allclose(glob, plain, rtol=0, atol=1e-5)
            assert np.abs(glob - plain).max() < 1e-3 * np.abs(plain).max()
    finally:
        t.shutdown()


def test_replicas_identical_at_start_and_after_every_outer_step(ray_session, tmp_path, corpus):
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__log_hashes=True, run__steps=15))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        workers = [r.rank0 for r in t.replicas]
        start = ray.get([w.params_hash.remote() for w in workers])
        assert len(set(start)) == 1
        prev = None
        for k in (1, 2, 3):
            row = t.outer_step(k)
            hashes = set(row["worker_global_sha256"]) | set(ray.get([w.global_hash.remote() for w in workers]))
            assert hashes == {row["global_sha256"]}, (k, hashes)
            assert row["global_sha256"] != prev  # the outer step moved the global parameters
            prev = row["global_sha256"]
            assert len(set(row["data_digest"])) == 2  # the replicas read different data
            # fp32 out and back, plus the 13-byte message header
            assert row["bytes_sent"] == 2 * RAW.message_nbytes(t.num_params) == row["bytes_received"]
            assert RAW.message_nbytes(t.num_params) == 4 * t.num_params + 13
    finally:
        t.shutdown()


def test_every_parameter_reaches_the_driver_and_comes_back(ray_session, tmp_path, corpus):
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__steps=10))
    t = start_trainer(cfg, corpus, odd_model_fn)
    try:
        (g0,) = ray.get(t.driver.global_params.remote())
        row = t.outer_step(1)
        (g1,) = ray.get(t.driver.global_params.remote())
        model = odd_model_fn(None, corpus.vocab_size)
        off = 0
        for name, p in model.named_parameters():
            n = p.numel()
            assert not np.array_equal(g0[off:off + n], g1[off:off + n]), f"{name} was not updated"
            off += n
        assert off == g1.size == t.num_params
        locals_ = ray.get([r.rank0.local_fragment.remote(0) for r in t.replicas])
        for loc in locals_:
            assert np.array_equal(loc, g1)
        assert row["bytes_sent"] == 2 * RAW.message_nbytes(7 * corpus.vocab_size + 105 + 15 * corpus.vocab_size
                                                            + corpus.vocab_size + 1)
    finally:
        t.shutdown()


def test_two_worker_ddp_replica_and_export(ray_session, tmp_path, corpus, small_text, monkeypatch):
    """M=1 x 2 workers (real 2-rank gloo DDP): both ranks hold the same local parameters after
    every outer step (``run.log_hashes``; within a round: ``test_ddp_ranks_hold_identical_parameters``);
    the export (written by the
    driver a parameter at a time from two outer-shard actors) loads in transformers and gives the
    checkpoint's loss; ``ray-diloco eval`` on the cluster (tasks with
    the run's worker resources, each reading outer.pt itself; or, where a task cannot see it, fed
    through the object store) gives the same loss as in one process."""
    from transformers import AutoModelForCausalLM

    from ray_diloco.components.evaluate import evaluate_run

    cfg = load_config(tiny_overrides(tmp_path, diloco__replicas=1, diloco__workers_per_replica=2,
                                     run__steps=20, run__eval_every=2, run__name="ddp", data__path=str(small_text),
                                     run__eval_tokens=4000,  # evaluations read a cut validation split
                                     run__log_hashes=True,  # each worker's parameters after every outer step
                                     diloco__outer_shards=2))  # the export reads each parameter from 2 shard actors
    summary = train(cfg)
    run_dir = tmp_path / "runs" / "ddp"
    assert summary["run_dir"] == str(run_dir) and json.loads((run_dir / "summary.json").read_text())["inner_steps"] == 20
    assert summary["final_eval_loss"] < np.log(corpus.vocab_size) - 0.5  # uniform prediction: ln(vocab)
    rows = read_metrics(run_dir)
    assert [r["outer_step"] for r in rows] == [1, 2, 3, 4] and [("eval_loss" in r) for r in rows] == [0, 1, 0, 1]
    for r in rows:  # both ranks' parameters, compared: equal to each other, and moved by every outer step
        assert len(r["worker_params_sha256"]) == 2 and len(set(r["worker_params_sha256"])) == 1, r["outer_step"]
    assert len({r["worker_params_sha256"][0] for r in rows}) == 4
    val = corpus.val[:4001]  # what the run's evaluations read (its recorded fingerprint is of this cut)
    assert len(corpus.val) > len(val)
    ckpt_loss, step, path = evaluate_run(run_dir)
    assert step == 4 and ckpt_loss == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    # other batches than one process's (fp32 means per batch): equal to ~1e-7
    assert evaluate_run_on_cluster(run_dir, workers=3)[0] == pytest.approx(ckpt_loss, rel=1e-6)
    state = load_checkpoint(path, lazy=True)
    total, count, parts = evaluate_on_cluster(state, load_config(state["config"], validate=False), val,
                                              corpus.vocab_size)
    assert total / count == pytest.approx(ckpt_loss, rel=1e-6) and count == val_windows(val, 16) * 16
    assert len(parts) == 2 and len({p["pid"] for p in parts}) == 2
    assert all(p["device"] == "cpu" and p["params"] == "file" for p in parts)
    # a checkpoint path the tasks cannot see (relative to this process's directory, not theirs)
    monkeypatch.chdir(path)
    state["outer"] = {**state["outer"], "file": "outer.pt"}
    again = evaluate_on_cluster(state, load_config(state["config"], validate=False), val, corpus.vocab_size)
    assert again[0] == pytest.approx(total, rel=1e-12) and {p["params"] for p in again[2]} == {"object store"}
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    n = val_windows(val, 16)
    total, count = evaluate_loss(model, val, 16, np.arange(n), 256)
    assert total / count == pytest.approx(ckpt_loss, abs=1e-6)
    assert (run_dir / "final" / "model.safetensors").is_file() and (run_dir / "final" / "tokenizer.json").is_file()
    # ready for transformers' generate: the char tokenizer has no EOS, so nothing stops it early, and
    # the KV cache is on
    assert model.config.eos_token_id is None and model.generation_config.eos_token_id is None
    assert model.config.use_cache and model.generation_config.use_cache
    out = model.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=12, do_sample=True, top_k=0)
    assert out.shape == (1, 13)


@pytest.mark.parametrize("micro_batch", [None, 1])
def test_ddp_ranks_hold_identical_parameters(ray_session, tmp_path, corpus, micro_batch):
    """Also with gradient accumulation (``inner.micro_batch`` 1 of a share of 2: DDP skips the
    all-reduce of the first pass, reduces on the last; a rank that skipped it would diverge)."""
    import ray

    cfg = load_config(tiny_overrides(tmp_path, diloco__replicas=1, diloco__workers_per_replica=2, run__steps=10,
                                     inner__micro_batch=micro_batch))
    t = start_trainer(cfg, corpus, torch_lm)
    try:
        t.outer_step(1)
        w = t.replicas[0].workers
        h = ray.get([x.params_hash.remote() for x in w])
        assert h[0] == h[1]
        digests = [m["data_digest"] for m in ray.get([x.train.remote(5, 7) for x in w])]
        assert digests[0] != digests[1]  # each rank reads its own shard
        h = ray.get([x.params_hash.remote() for x in w])  # inner steps, no merge: DDP's all-reduce alone
        assert h[0] == h[1]
    finally:
        t.shutdown()


def test_bf16_autocast_trains_and_keeps_fp32_outer_state(ray_session, tmp_path, corpus):
    import ray

    cfg = load_config(tiny_overrides(tmp_path, run__precision="bf16", run__steps=10, model__family="qwen3"))
    t = start_trainer(cfg, corpus)
    try:
        rows = [t.outer_step(k) for k in (1, 2)]
        assert all(np.isfinite(r["train_loss"]) for r in rows) and rows[1]["train_loss"] < rows[0]["train_loss"]
        (glob,) = ray.get(t.driver.global_params.remote())
        assert glob.dtype == np.float32 and np.isfinite(glob).all()
        assert np.isfinite(t.evaluate())
    finally:
        t.shutdown()


def test_custom_model_and_corpus_run_evaluates_from_python_only(ray_session, tmp_path, corpus):
    from ray_diloco.components.evaluate import evaluate_run, generate
    from ray_diloco.errors import CheckpointError, DataError

    cfg = load_config(tiny_overrides(tmp_path, run__steps=10, run__name="odd"))
    summary = train(cfg, model_fn=odd_model_fn, corpus=corpus)
    run_dir = tmp_path / "runs" / "odd"
    assert (run_dir / "final" / "model.pt").is_file()
    with pytest.raises(CheckpointError, match="custom model_fn"):
        evaluate_run(run_dir, corpus=corpus)
    with pytest.raises((CheckpointError, DataError), match="corpus"):
        evaluate_run(run_dir, model_fn=odd_model_fn)  # the config's corpus is not the one trained on
    loss, step, _ = evaluate_run(run_dir, model_fn=odd_model_fn, corpus=corpus)
    assert step == 2 and loss == pytest.approx(summary["final_eval_loss"], abs=1e-5)
    assert len(generate(run_dir, "ROMEO:", 10, model_fn=odd_model_fn)) >= 10


def test_resume_refuses_structural_changes(tmp_path):
    from ray_diloco.components.export import model_with_params
    from ray_diloco.errors import CheckpointError, ConfigError
    from ray_diloco.runtime.launcher import _check_resumable

    saved = load_config(tiny_overrides(tmp_path))
    _check_resumable(load_config(tiny_overrides(tmp_path, run__steps=99, outer__lr=0.5)), saved)  # allowed
    with pytest.raises(ConfigError) as e:
        _check_resumable(load_config(tiny_overrides(tmp_path, diloco__replicas=1, model__d_model=64)), saved)
    assert len(e.value.problems) == 2 and any("diloco.replicas = 1" in p for p in e.value.problems)
    with pytest.raises(ConfigError, match="diloco.H"):
        _check_resumable(load_config(tiny_overrides(tmp_path, diloco__H=10)), saved)
    with pytest.raises(ConfigError, match="streaming.fragments = 2: the checkpoint was trained with 1"):
        _check_resumable(load_config(tiny_overrides(tmp_path, streaming__fragments=2)), saved)
    _check_resumable(load_config(tiny_overrides(tmp_path, streaming__quantization="int8")), saved)  # allowed
    with pytest.raises(CheckpointError, match="parameters"):
        model_with_params(saved, [np.zeros(10, np.float32)], 50)
    from ray_diloco.runtime.launcher import prepare

    with pytest.raises(ConfigError, match="--resume"):
        prepare("dp", resume=tmp_path)


def _fake_run(tmp_path, name: str, cfg_dict: dict, inner_step: int, params: list | None = None):
    """A run directory with config.yaml and one checkpoint (no Ray): what --resume and eval read."""
    import yaml

    from ray_diloco.components.checkpoint import save_checkpoint

    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    state = {"format": 1, "outer_step": 1, "config": cfg_dict, "counters": {"inner_step": inner_step},
             "outer": {"global": params} if params is not None else None, "workers": {}, "corpus_fingerprint": ""}
    save_checkpoint(run_dir, 1, state, keep=1)
    return run_dir


def test_a_run_records_its_model_shape_and_runs_recorded_before_keep_theirs(tmp_path):
    """A run's config pins every shape field (config.yaml and checkpoints name the model trained,
    not a preset whose meaning may change). A run recorded before that (fields None) evaluates,
    samples and resumes as the model it trained: `tiny` was then a llama of FFN 352. Resume
    compares resolved shapes, so restating the trained family is allowed and another is refused
    with one line, the run directory untouched. Fewer steps than already trained are refused."""
    from ray_diloco.components.evaluate import model_from_checkpoint
    from ray_diloco.errors import ConfigError
    from ray_diloco.models.transformer import build_transformers_model, pin_model_fields, resolve_model_shape
    from ray_diloco.runtime.launcher import prepare

    new = pin_model_fields(load_config({}).model)
    assert (new.family, new.n_layers, new.n_heads, new.d_model, new.d_ff, new.context) == ("gpt2", 4, 4, 128, 512, 64)

    old = load_config({"run": {"steps": 40, "output_dir": str(tmp_path / "runs")}, "diloco": {"H": 10}}).to_dict()
    assert old["model"]["family"] is None and old["model"]["d_ff"] is None  # as runs wrote it before
    torch.manual_seed(0)
    llama = build_transformers_model(resolve_model_shape(load_config(
        {"model": {"family": "llama", "d_ff": 352}}).model, 65))
    frag = plan_fragments(param_specs(llama), 1)
    params = [flatten(dict(llama.named_parameters()), f).detach().numpy() for f in frag]
    run_dir = _fake_run(tmp_path, "old", old, inner_step=20, params=params)
    before = tree(run_dir)

    model = model_from_checkpoint({"config": old, "outer": {"global": params}}, 65)  # eval and generate load this
    x = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert type(model).__name__ == "LlamaForCausalLM" and torch.equal(model(x).logits, llama.eval()(x).logits)

    cfg, _, _ = prepare(resume=run_dir)
    assert (cfg.model.family, cfg.model.d_ff) == ("llama", 352)
    cfg, _, _ = prepare(resume=run_dir, overrides=["model.family=llama", "model.d_ff=352", "run.steps=60"])
    assert cfg.run.steps == 60
    with pytest.raises(ConfigError) as e:
        prepare(resume=run_dir, overrides=["model.family=gpt2"])
    assert e.value.problems == ["model.family = 'gpt2': the checkpoint was trained with 'llama'; it cannot change on resume"]
    with pytest.raises(ConfigError) as e:
        prepare(resume=run_dir, overrides=["run.steps=15"])
    assert e.value.problems == ["run.steps = 15: the checkpoint has already trained 20 inner steps; give at least 20 "
                                "(more extends the run)"]
    assert tree(run_dir) == before

    pinned = load_config({"run": {"steps": 40, "output_dir": str(tmp_path / "runs")}})
    pin_model_fields(pinned.model)
    gpt2_dir = _fake_run(tmp_path, "new", pinned.to_dict(), inner_step=20)
    assert prepare(resume=gpt2_dir, overrides=["model.family=gpt2"])[0].model.family == "gpt2"


def test_a_run_that_died_before_its_first_checkpoint_restarts_and_dp_matches_its_metrics(ray_session, tmp_path,
                                                                                        corpus):
    """A start-up failure leaves config.yaml (and a metrics row or two) but no checkpoint: --resume
    runs it again from step 0 with its config instead of refusing the directory, and the stale
    metrics rows are dropped. The DP baseline of the same config (``algorithm: dp``) then runs on
    the same workers, data and schedule: the same metrics per outer step (inner steps, tokens, inner
    lr, evaluations), no outer exchange, and it trains."""
    over = dict(run__steps=20, run__seed=3, diloco__cpus_per_worker=0.5)
    cfg = load_config(tiny_overrides(tmp_path, run__name="early", **over))
    run_dir = tmp_path / "runs" / "early"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    (run_dir / "metrics.jsonl").write_text(json.dumps({"outer_step": 1, "inner_step": 5, "train_loss": 9.9}) + "\n")
    summary = train(None, resume=run_dir, corpus=corpus, model_fn=torch_lm)
    assert summary["inner_steps"] == 20 and summary["config"]["run"]["seed"] == 3
    rows = read_metrics(run_dir)
    assert [r["outer_step"] for r in rows] == [1, 2, 3, 4] and rows[0]["train_loss"] != 9.9

    dp = train(load_config(tiny_overrides(tmp_path, algorithm="dp", run__name="dp", **over)), corpus=corpus,
               model_fn=torch_lm)
    dp_rows = read_metrics(tmp_path / "runs" / "dp")
    assert dp["algorithm"] == "dp" and dp["bytes_sent"] == 0 < summary["bytes_sent"]
    assert dp["final_eval_loss"] < np.log(corpus.vocab_size) - 0.5 and summary["tokens"] == dp["tokens"]
    assert {"train_loss", "inner_lr", "tokens_per_s", "inner_compute_s", "eval_loss"} <= set(dp_rows[-1])
    for key in ("outer_step", "inner_step", "tokens", "inner_lr"):
        assert [r[key] for r in dp_rows] == [r[key] for r in rows], key
    assert [("eval_loss" in r) for r in dp_rows] == [("eval_loss" in r) for r in rows]
    # the same metrics, less those of the outer exchange and of replica membership that DP has not
    assert set(rows[-1]) - set(dp_rows[-1]) == {"fragment_syncs", "membership", "outer_update_norm", "pseudo_grad_norm",
                                                "replicas_live", "replicas_target", "sync_bytes_fragment"}
    assert set(dp_rows[-1]) <= set(rows[-1]), set(dp_rows[-1]) - set(rows[-1])


def test_export_replaces_what_is_at_final_and_leaves_no_temporary(tmp_path):
    """The export swaps the new model in (``final.tmp`` renamed, the old one moved to
    ``final.old`` and then deleted): a previous export, or a file in the way (found by a break-it
    pass: it failed the run after training), is replaced, and nothing temporary is left."""
    from ray_diloco.components.export import export_model

    cfg = load_config(tiny_overrides(tmp_path))
    model = odd_model_fn(None, 11)
    params = [torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()]
    out = tmp_path / "final"
    out.write_text("in the way")
    export_model(cfg, params, 11, None, out, odd_model_fn)
    (out / "junk.txt").write_text("from an older export")
    export_model(cfg, params, 11, None, out, odd_model_fn)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("final")) == ["final"]
    assert [p.name for p in out.iterdir()] == ["model.pt"]
    state = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_gpus_asked_for_without_cuda_stop_the_worker_in_one_line(ray_session):
    """``diloco.gpus_per_worker`` > 0 where torch has no CUDA (a CPU build on a GPU node): the
    worker's setup raises a ClusterError naming the field and the fix (the launcher prints it as
    the run's one error line), instead of training on CPU."""
    from ray_diloco.errors import ClusterError
    from ray_diloco.runtime.replica import ReplicaWorkerActor, worker_device

    ray = ray_session
    assert worker_device(0) == (torch.device("cpu"), None)
    cfg = load_config({"diloco": {"gpus_per_worker": 1}}).to_dict()
    w = ReplicaWorkerActor.options(num_cpus=0).remote(cfg, 0, 0, 1, 0, 1, 65)  # no GPU resource: Ray would wait
    tokens = np.zeros(4096, np.int32)
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(w.setup.remote(None, tokens, tokens))
    cause = e.value.cause
    assert isinstance(cause, ClusterError) and len(str(cause).splitlines()) == 1
    assert str(cause).startswith("diloco.gpus_per_worker = 1: torch ") and "has no CUDA" in str(cause)
    assert "diloco.gpus_per_worker=0" in str(cause)
    ray.kill(w)
