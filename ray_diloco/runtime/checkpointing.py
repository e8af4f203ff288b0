"""Checkpoints of a run, written and read by the processes that hold the state (the Ray side of
:mod:`ray_diloco.components.checkpoint`): each worker writes its own file, the outer-optimiser
driver ``outer.pt``, the trainer's process only ``state.pt``; a resume has each process read its
own file. A process whose node does not see the run directory sends its state through the
trainer's process instead."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray_diloco.components.checkpoint import (
    OUTER_FILE,
    begin_checkpoint,
    finish_checkpoint,
    place_marker,
    read_state_file,
    visible_file,
    worker_file,
)
from ray_diloco.components.storage import join_uri
from ray_diloco.config import Config
from ray_diloco.core.fragments import Fragment
from ray_diloco.errors import CheckpointError
from ray_diloco.runtime.layout import ReplicaLayout
from ray_diloco.runtime.run_state import RunState

if TYPE_CHECKING:
    from ray_diloco.components.mirror import Mirror
    from ray_diloco.runtime.membership import Membership
    from ray_diloco.runtime.strategy import SyncStrategy
    from ray_diloco.runtime.supervisor import Supervisor

logger = logging.getLogger(__name__)


class Checkpointer:
    """Writes a run's checkpoints and restores its workers from one (see the module docstring).

    Args:
        cfg: the run's config (the resolved one: what checkpoints record).
        run_dir: the run directory. supervisor: calls every live worker (a replica lost meanwhile
            is left out). sync: the sync strategy (writes the outer state). members: the replicas'
            membership (its state is checkpointed). mirror: the copy of the run in
            ``run.storage_path`` (writers upload their files there too), or None.
        corpus_fingerprint: the corpus's fingerprint (a resume checks it). custom_model: the run
            trains a ``model_fn``'s model, not a preset.
    """

    def __init__(self, cfg: Config, run_dir: Path, supervisor: Supervisor, sync: SyncStrategy, members: Membership,
                 mirror: Mirror | None, corpus_fingerprint: str, custom_model: bool):  # fmt: skip
        self.cfg, self.run_dir, self.supervisor, self.sync = cfg, run_dir, supervisor, sync
        self.members, self.mirror = members, mirror
        self.identity = {"corpus_fingerprint": corpus_fingerprint, "custom_model": custom_model}

    def restore_workers(self, rs: dict[str, Any]) -> None:
        """The live workers from the checkpoint ``rs``: inner-optimiser state and local parameters
        (DDP: rank 0's, for every rank of its replica; FSDP: each rank's own rows), data position,
        RNG and syncs in flight (each worker's own). A checkpoint of per-worker files: each worker
        reads its own (a file its node cannot see is read here and sent)."""
        import ray

        states, cid = rs["workers"], rs.get("checkpoint_id")
        layout = ReplicaLayout.of_run(self.cfg)
        calls = []
        for r in self.supervisor.replicas:
            for rank, w in enumerate(r.workers):
                own, full = (
                    states[(r.index, rank)],
                    None if layout.owns(rank) else states[(r.index, layout.owner(rank))],
                )
                calls.append(((r.index, rank), w, own, full, w.restore_state.remote(own, full, cid)))
        for key, w, own, full, ref in calls:
            if not ray.get(ref):  # this worker's node does not see the run directory: through the job
                own, full = (  # a damaged file fails here (the worker took it for another node's), with no note
                    read_state_file(Path(x["file"])) if x is not None and "file" in x else x for x in (own, full)
                )
                logger.warning(f"note: worker {key} does not see its checkpoint file: it was read here and sent")
                ray.get(w.restore_state.remote(own, full, cid))

    def write(self, st: RunState, fragments: list[Fragment]) -> Path:
        """Write the checkpoint of ``st`` (the run's counters; ``fragments``: the model's)
        atomically: every worker writes its own state file and the driver the outer state, into
        the checkpoint's temporary directory; this process writes only the small ``state.pt``
        naming them (:mod:`~ray_diloco.components.checkpoint`), then renames the directory. It
        never holds the model or an optimiser state (unless a writer's node cannot see the run
        directory: that state comes here and is written inline, with a note). Syncs in flight
        are answered first."""
        self.supervisor.settle()
        cfg, layout = self.cfg, ReplicaLayout.of_run(self.cfg)
        name = f"step_{st.outer_step:06d}"
        # run.storage_path: each writer uploads its own file there too (in parallel, from its node)
        remote = self.mirror.checkpoint_uri(name) if self.mirror is not None else None
        tmp = begin_checkpoint(self.run_dir, st.outer_step)  # absolute: the writers' directories differ
        try:
            token = place_marker(tmp)  # a writer that does not read it there does not share the run directory
            written = self.supervisor.on_live(
                "save_state",
                lambda r, rank, i, n: (
                    str(tmp / worker_file(r.index, rank)),
                    layout.owns(rank),
                    token,
                    remote and join_uri(remote, worker_file(r.index, rank)),
                ),
            )
            _refuse_errors(tmp.parent / name, written.values())  # a worker's disk full fails the checkpoint only
            workers = {key: self._visible(tmp, info, key, st) for key, info in written.items()}
            saved = self.sync.save_state(tmp / OUTER_FILE, token, remote and join_uri(remote, OUTER_FILE))
            _refuse_errors(tmp.parent / name, [saved or {}])  # the outer side's file, as a worker's
            outer = self._visible(tmp, saved, None, st) if saved is not None else None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._uploaded(name, [*written.values(), saved or {}])
        state = {
            "format": 2,
            "outer_step": st.outer_step,
            "config": cfg.to_dict(),
            **self.identity,
            "counters": dataclasses.asdict(st),
            "outer": outer,
            "workers": workers,
            "membership": self.members.state_dict(),
            "sizes": [f.numel for f in fragments],
            "checkpoint_id": token,
        }
        if layout.sharded:  # the outer state holds W parts per fragment (core.shards.exchange_index)
            state["exchange_units"] = cfg.exchange_units
            state["fragments"] = [[(p.name, tuple(p.shape)) for p in f.params] for f in fragments]

        with signals_deferred(replay=True):  # Ctrl-C / SIGTERM inside torch.save would fail the write
            return finish_checkpoint(self.run_dir, st.outer_step, tmp, state, cfg.run.keep_checkpoints)

    def _uploaded(self, name: str, infos: list[dict[str, Any]]) -> None:
        """Tell the mirror which files of checkpoint ``name`` their writers uploaded (the rest it uploads)."""
        if self.mirror is None:
            return
        self.mirror.uploaded_by_writers(name, {i["file"] for i in infos if i.get("uploaded")})
        problems = [i["upload_error"] for i in infos if "upload_error" in i]
        if problems:
            logger.warning(
                f"note: {len(problems)} checkpoint writer(s) could not upload to {self.mirror.uri} "
                f"({problems[0]}): this process uploads their files"
            )

    def _visible(self, tmp: Path, info: dict[str, Any], key: tuple[int, int] | None, st: RunState) -> dict[str, Any]:
        """``{"file", "bytes"}`` when this process sees the file a worker (``key``) or the driver
        (None) wrote, with its size; else (its node does not share the run directory) the state
        itself, fetched here, with a note.

        Raises:
            CheckpointError: that worker died before its state could be fetched."""
        import ray

        if "file" in info and visible_file({"file": str(tmp / info["file"]), "bytes": info["bytes"]}):
            return {"file": info["file"], "bytes": info["bytes"]}
        who = "the outer-optimiser driver" if key is None else f"worker {key}"
        logger.warning(
            f"note: {who} on node {info['node']} does not see {self.run_dir}: its checkpoint state goes "
            "through this process (put run.output_dir on a file system every node shares)"
        )
        if key is None:
            state = self.sync.state_dict()
            assert state is not None  # save_state wrote something: there is a sync-side state
            return state
        try:
            r = next(r for r in self.supervisor.replicas if r.index == key[0])
            return ray.get(r.workers[key[1]].state_dict.remote(ReplicaLayout.of_run(self.cfg).owns(key[1])))
        except (StopIteration, ray.exceptions.RayError):
            raise CheckpointError(
                f"checkpoint of outer step {st.outer_step}: replica {key[0]} was lost while "
                "its state was fetched; the next checkpoint goes without it"
            ) from None


@contextlib.contextmanager
def signals_deferred(replay: bool = False):
    """Hold SIGINT/SIGTERM inside the block (main thread only), then restore the handlers. With
    ``replay`` the first signal that arrived meanwhile is delivered after the block (a checkpoint
    write finishes, then the run stops); without, it is dropped (clean-up already under way)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    pending: list[int] = []
    for sig in saved:
        signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if replay and pending:
            signal.raise_signal(pending[0])


def _refuse_errors(where: Path, infos: Any) -> None:
    """Raise the first ``{"error": line}`` of the writers' answers
    (``components.checkpoint.write_own_file``) as the checkpoint's ``CheckpointError``."""
    for info in infos:
        if "error" in info:
            raise CheckpointError(f"checkpoint {where}: {info['error']}")
