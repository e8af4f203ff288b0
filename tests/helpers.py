"""Helpers shared by the test files: tiny configs, test models, the CLI in or out of process, run
directories, waiting on a condition. One importable module, so Ray workers that build a test model
need only ``tests/`` on their path."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "ray_diloco" / "data" / "tinyshakespeare.txt"


def tiny_overrides(tmp_path: Path, **extra) -> dict:
    """A config dict for a ~24k-parameter model (the `tiny` preset's family, shrunk) that trains
    in seconds on 2 cores."""
    cfg = {
        "model": {"preset": "tiny", "n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64, "context": 16},
        "data": {"seq_len": 16},
        "inner": {"lr": 3e-3, "warmup_steps": 2, "global_batch": 4},
        "outer": {"lr": 0.7, "momentum": 0.9},
        "diloco": {"replicas": 2, "workers_per_replica": 1, "H": 5},
        "run": {"steps": 15, "eval_every": 1, "eval_batch": 256, "checkpoint_every": 1,
                "output_dir": str(tmp_path / "runs"), "keep_checkpoints": 10},
        "tracking": {"wandb": False, "progress": False},
    }
    for key, value in extra.items():
        if "__" not in key:
            cfg[key] = value
            continue
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    return cfg



def save_tiny_model(path: Path, text: str, family: str = "llama", dtype: torch.dtype = torch.float32,
                    tie: bool = False) -> Path:
    """README's tiny llama (``examples/tiny_llama.py``: 2 layers, width 32, grouped-query attention,
    RoPE base 5000, a char-level tokenizer of ``text``), saved at ``path`` in the layout of a released model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_llama", ROOT / "examples" / "tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_tiny_model(path, text, family, dtype, tie)


class TorchLM(torch.nn.Module):
    """A tiny pure-torch decoder (token + position embeddings, pre-norm blocks of causal attention
    and a GELU MLP, final norm, head): ``[B, T]`` int64 ids to ``[B, T, vocab]`` fp32 logits.

    Tests of the DiLoCo machinery (outer steps, elasticity, streaming) train it instead of the
    transformers presets: a Ray actor that builds it imports no transformers, which saves about 4 s
    of CPU per actor on this machine. Its blocks are ``blocks.<i>.``, so fragments follow them.
    The transformers path is what the CLI, export and model tests train."""

    def __init__(self, shape: dict, vocab_size: int):
        super().__init__()
        d, self.heads = shape["d_model"], shape["n_heads"]
        self.embed = torch.nn.Embedding(vocab_size, d)
        self.pos = torch.nn.Embedding(shape["context"], d)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.LayerNorm(d), "qkv": torch.nn.Linear(d, 3 * d), "proj": torch.nn.Linear(d, d),
            "norm2": torch.nn.LayerNorm(d), "up": torch.nn.Linear(d, shape["d_ff"]),
            "down": torch.nn.Linear(shape["d_ff"], d)}) for _ in range(shape["n_layers"]))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](torch.nn.functional.gelu(blk["up"](blk["norm2"](x))))
        return self.head(self.norm(x))


def torch_lm(shape: dict, vocab_size: int) -> torch.nn.Module:
    """``model_fn`` building :class:`TorchLM` from the resolved model shape."""
    return TorchLM(shape, vocab_size)


def run_cli(args: list[str], timeout: float = 600, env: dict | None = None):
    """Run ``ray-diloco ARGS`` in a fresh process; returns CompletedProcess (text)."""
    import subprocess

    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ray_diloco.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=str(ROOT))


def start_trainer(cfg, corpus, model_fn=None, resume_state=None, mirror_to=None):
    """A started :class:`~ray_diloco.runtime.trainer.Trainer` in a new run directory of ``cfg``:
    the outer-step loop driven by hand (``t.outer_step(k)``) in integration tests. ``mirror_to``:
    a storage path the run directory is mirrored to."""
    from ray_diloco.components.mirror import Mirror
    from ray_diloco.runtime.launcher import new_run_dir
    from ray_diloco.runtime.trainer import Trainer

    run_dir = new_run_dir(cfg)
    mirror = Mirror(run_dir, mirror_to) if mirror_to else None
    t = Trainer(cfg, run_dir, corpus, model_fn, resume_state, mirror=mirror)
    t.start()
    return t


class UnitGrad(torch.autograd.Function):
    """Passes ``logits`` through; the gradient reaching ``s`` is exactly 1, whatever the data."""

    @staticmethod
    def forward(ctx, s, logits):
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones(()), grad


class TwoBlocks(torch.nn.Module):
    """Two 'blocks' whose every parameter gets gradient exactly 1: with AdamW betas (0, 0), no
    weight decay, no clipping, eps far below one ulp of 1 and a constant lr, every inner step
    moves every parameter by exactly -lr (a known constant inner update)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 5), torch.nn.Linear(4, 2)])

    def forward(self, input_ids):
        s = sum(p.sum() for p in self.parameters())
        return UnitGrad.apply(s, torch.zeros(*input_ids.shape, self.vocab))


def two_blocks_fn(shape, vocab_size):
    return TwoBlocks(vocab_size)


def core_diloco_reference(cfg_dict, train_tokens, vocab_size, rounds):
    """Plain DiLoCo (arXiv 2311.08105, Algorithm 1) written out in one process, for comparison: each
    replica's AdamW loop on its own shard, the mean pseudo-gradient, torch's Nesterov SGD.
    Returns sha256 of the global parameters after each outer step."""
    import hashlib

    from ray_diloco.components.data import ShardReader
    from ray_diloco.config import load_config
    from ray_diloco.core.schedules import inner_lr, outer_step_bounds
    from ray_diloco.models.transformer import build_model, lm_loss, logits_of, make_inner_optimizer

    torch.set_num_threads(1)
    cfg = load_config(cfg_dict, validate=False)
    M, i = cfg.diloco.replicas, cfg.inner
    models = [build_model(cfg, vocab_size) for _ in range(M)]
    opts = [make_inner_optimizer(m, cfg) for m in models]
    readers = [ShardReader(train_tokens, cfg.data.seq_len, m, M, cfg.run.seed) for m in range(M)]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    theta = flat(models[0]).clone()
    outer = torch.optim.SGD([theta], lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=True)
    hashes = []
    for k in range(1, rounds + 1):
        start, end = outer_step_bounds(k, cfg.diloco.H, cfg.run.steps)
        for model, opt, reader in zip(models, opts, readers):
            for step in range(start, end):
                for g in opt.param_groups:
                    g["lr"] = inner_lr(step, i.lr, i.warmup_steps, cfg.run.steps, i.min_lr_ratio)
                x, y, _ = reader.next_batch(cfg.batch_per_worker)
                loss, _ = lm_loss(logits_of(model(x)), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), i.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
        mean = torch.zeros_like(theta)
        for model in models:
            mean.add_(theta - flat(model), alpha=1 / M)
        theta.grad = mean
        outer.step()
        with torch.no_grad():
            for model in models:
                off = 0
                for p in model.parameters():
                    p.copy_(theta[off:off + p.numel()].view_as(p))
                    off += p.numel()
        hashes.append(hashlib.sha256(theta.numpy().tobytes()).hexdigest())
    return hashes


class OddShapes(torch.nn.Module):
    """A model whose parameters are a scalar, 1-D, 2-D and 3-D tensors of odd sizes."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(vocab, 7) * 0.1)
        self.cube = torch.nn.Parameter(torch.randn(7, 3, 5) * 0.1)
        self.proj = torch.nn.Parameter(torch.randn(15, vocab) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(vocab))
        self.gain = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, input_ids):
        h = torch.tanh(self.emb[input_ids] @ self.cube.reshape(7, 15)) * self.gain
        return h @ self.proj + self.bias


def odd_model_fn(shape, vocab_size):
    return OddShapes(vocab_size)


# ---------------------------------------------------------------------------------------
# the CLI, run directories, processes


def one_error_line(proc: subprocess.CompletedProcess, *needles: str, code: int = 2) -> str:
    """Assert that ``proc`` (the CLI run out of process, or :func:`run_main` in process) failed with
    exit ``code``, no traceback and exactly one ``error:`` line on stderr holding every needle;
    returns that line."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def run_main(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``ray-diloco ARGS`` through :func:`ray_diloco.cli.main` in this process (the console
    script's code without a new interpreter): stdout and stderr captured, ``env`` set for the call,
    and the SIGTERM handler and ``address.GRACEFUL_SIGTERM`` that ``main`` installs put back."""
    from ray_diloco.cli import main
    from ray_diloco.components import address

    saved = signal.getsignal(signal.SIGTERM), address.GRACEFUL_SIGTERM
    old_env = {k: os.environ.get(k) for k in (env or {})}
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env or {})
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        address.GRACEFUL_SIGTERM = saved[1]
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(["ray-diloco", *args], rc or 0, out.getvalue(), err.getvalue())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` (one JSON object per outer step)."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def tree(root: str | Path) -> list[tuple[str, int]]:
    """Every path under ``root`` with its modification time (ns): equal snapshots mean nothing
    was written, replaced or removed."""
    root = Path(root)
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*"))


def wait_for(pred: Callable[[], object], timeout: float, what: str, poll: float = 0.05):
    """Poll ``pred`` until it returns something true (returned); fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(poll)
    return value


def descendants(pid: int) -> list[int]:
    """PIDs of every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pids_with(needle: str) -> list[int]:
    """PIDs of this machine's processes (not this one) whose command line contains ``needle``."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                found.append(int(d))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# oracles: the outer step and the downlink written out in one call each, for tests to compare the
# driver's chunked, in-place production path with (core.outer.OuterOptimizer.step_ordered and
# core.wire.Downlink.encode_update)


def ordered_mean(deltas: list, weights: list[float]):
    """The ``core.outer.OrderedMean`` of pseudo-gradients ``[numel]`` fp32 (weights: tokens
    trained) in the order given, as the driver adds them; a zero-weight term is checked for size
    and left out. Raises ValueError on empty input, mismatched shapes or a total weight <= 0."""
    import numpy as np

    from ray_diloco.core.outer import OrderedMean

    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"got {len(deltas)} pseudo-gradients and {len(weights)} weights")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"total weight {total} must be > 0")
    mean = OrderedMean(np.asarray(deltas[0]).size)
    for d, w in zip(deltas, weights):
        if w > 0:
            mean.add(d, w)
        elif np.asarray(d).size != mean.numel:
            raise ValueError(f"pseudo-gradient has {np.asarray(d).size} values, expected {mean.numel}")
    return mean


def average_pseudo_gradients(deltas: list, weights: list[float]) -> torch.Tensor:
    """The weighted fp32 mean of pseudo-gradients as the driver computes it (bit for bit)."""
    return ordered_mean(deltas, weights).take()


def outer_step(opt, fragment: int, weights: list[float], *deltas, average_only: bool = False) -> dict:
    """One outer step of ``opt`` (a ``core.outer.OuterOptimizer``) on ``fragment`` with the
    replicas' pseudo-gradients (fp32 ``[numel_p]``) in the order given: ``step_ordered`` on their
    :func:`ordered_mean` (DiLoCo, arXiv 2311.08105, Algorithm 1 lines 8-12; ``average_only``: the
    closing round, the global fragment becomes the replicas' mean). Returns ``{"before": fp32
    [numel_p] (the global fragment before the step), "update_norm", "step", "delta_norms"}``."""
    import numpy as np

    p = opt.fragments[fragment].param
    mean = ordered_mean(list(deltas), list(weights))
    if mean.numel != p.numel():
        raise ValueError(f"pseudo-gradient has {mean.numel} values, expected {p.numel()}")
    before = p.clone()
    opt.step_ordered(fragment, mean, average_only)
    return {"before": before, "update_norm": float((p - before).norm()), "step": opt.fragments[fragment].steps,
            "delta_norms": [float(np.linalg.norm(np.asarray(d, dtype=np.float32))) for d in deltas]}


def encode(x, fmt: str):
    """A host encoding (``core.formats.Packed``) of a float vector (any shape, flattened; fp32
    maths) in ``fmt``: a scaled format on the host through the fused codec, which refuses
    non-finite values as it encodes; the others checked first.

    Raises:
        ValueError: unknown format, or non-finite values in ``x``."""
    import numpy as np

    from ray_diloco.core.formats import Packed, check_finite, wire_format
    from ray_diloco.core.quantize import encode_tensor

    f = wire_format(fmt)
    t = (x.detach().cpu().float().reshape(-1) if isinstance(x, torch.Tensor)
         else torch.from_numpy(np.ascontiguousarray(x, np.float32).reshape(-1)))
    if not f.scaled:
        check_finite(t)
    payload, scales = encode_tensor(t, f)
    return Packed(f.name, t.numel(), payload.numpy(), scales.numpy())


def quantize_with_feedback(x: torch.Tensor, fmt: str, residual: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
    """Error feedback: encode ``x + residual`` (fp32 ``[n]``; ``residual`` None: zero) and return
    ``(message, new residual)`` (``core.quantize.encode_message`` into a new tensor on ``x``'s
    device).

    Raises:
        ValueError: non-finite values."""
    from ray_diloco.core.quantize import encode_message

    new = torch.empty(x.numel(), dtype=torch.float32, device=x.device)
    return bytes(encode_message(x, fmt, residual, new)), new


def encode_downlink(old_global: torch.Tensor, new_global: torch.Tensor, fmt: str,
                    residual: torch.Tensor | None = None) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    """The driver's reply for one outer step of a fragment (fp32 ``[numel_p]`` before and after)
    in ``fmt``: ``(message, applied, new_residual)``. ``none``: the new values themselves;
    otherwise the update ``new - old`` (+ ``residual``) quantised, ``applied`` what every receiver
    decodes (``core.wire.apply_downlink``), ``new_residual`` what the encoding lost."""
    from ray_diloco.core.formats import to_message, wire_format
    from ray_diloco.core.wire import apply_downlink

    if wire_format(fmt).raw:
        return to_message(encode(new_global, fmt)), new_global, residual
    message, new_residual = quantize_with_feedback(new_global - old_global, fmt, residual)
    return message, apply_downlink(old_global, message), new_residual


def downlink_encode(downlink, opt, fragment: int, before: torch.Tensor) -> bytes:
    """The message of the step ``opt`` just took on ``fragment`` from ``before``, with
    ``downlink``'s (a ``core.wire.Downlink``) format and residuals; ``opt``'s global fragment
    becomes the decoded value, as the driver's ``Downlink.encode_update`` leaves it."""
    frag = opt.fragments[fragment]
    message, applied, residual = encode_downlink(before, frag.param, downlink.fmt, frag.residual)
    if downlink.error_feedback:
        frag.residual = residual
    opt.set_global(fragment, applied)
    return message


def pseudo_gradients(seed: int, n: int, m: int) -> list:
    """``m`` random fp32 pseudo-gradients ``[n]`` (seeded), as replicas would send them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(m)]


def pending_rounds(driver) -> int:
    """Open rounds (waiting for pseudo-gradients or closing) of an ``OuterDriverActor``."""
    import ray

    return ray.get(driver.__ray_call__.remote(lambda d: len(d.book.rounds)))


def member_ids(driver) -> dict[int, int]:
    """``{replica id: join step}`` of an ``OuterDriverActor``'s current members."""
    import ray

    return ray.get(driver.__ray_call__.remote(lambda d: dict(d.book.members)))


def data_windows(worker):
    """Training windows (int64 ``[per_shard]``) a ``ReplicaWorker``'s shard reads in its current epoch."""
    import numpy as np
    import ray

    def windows(w):
        r = w.parts.reader  # either window order: a numpy permutation's or a Feistel permutation's
        return np.asarray(r._windows(r.epoch, np.arange(r.per_shard, dtype=np.int64)), dtype=np.int64)

    return ray.get(worker.__ray_call__.remote(windows))


class SyncRecorder:
    """A ``FragmentSync.observe`` callback that keeps one record per sync: at the send the
    fragment, send step, global and local fp32 values; at the merge the apply step, new global,
    local values before the merge and the merged values."""

    def __init__(self):
        self.records: list[dict] = []

    def __call__(self, event: str, tensors: dict) -> None:
        if event == "sent":
            self.records.append(dict(tensors))
            return
        rec = next(r for r in reversed(self.records)
                   if r["fragment"] == tensors["fragment"] and r["send_step"] == tensors["send_step"])
        rec.update(tensors)


def record_syncs(workers) -> None:
    """Start recording every sync of each ``ReplicaWorker`` (:class:`SyncRecorder`)."""
    import ray

    ray.get([w.__ray_call__.remote(lambda self: self.parts.sync.observe(SyncRecorder())) for w in workers])


def sync_records(workers) -> list:
    """The records of :func:`record_syncs`, per worker."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda self: self.parts.sync.on_sync.records) for w in workers])

