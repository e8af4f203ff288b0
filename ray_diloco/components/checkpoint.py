"""Atomic checkpoints of everything an exact resume needs, written by the processes that hold it.

Layout: ``RUN_DIR/checkpoints/step_{outer:06d}/``. A checkpoint is written into a temporary
directory next to its final place (:func:`begin_checkpoint`), flushed to disk, then renamed
(:func:`finish_checkpoint`, atomic on POSIX), so a killed process leaves either the whole
checkpoint or none. The last ``keep`` are kept.

Files (``torch.save``, numpy arrays stored as tensors, loaded with ``weights_only=True``):

* ``worker-{replica}-{rank}.pt``: one worker's state (inner-optimiser state, local parameters,
  data position, RNG, syncs in flight), written by that worker (:func:`write_state_file`);
* ``outer.pt``: the outer side's state (global parameters, outer-optimiser buffers per fragment),
  written by the outer-optimiser driver;
* ``state.pt``: written last by the job: config, counters, corpus fingerprint, membership, the
  fragment sizes, and ``{"file": NAME}`` in place of each state above. The job's process never
  holds the model or its optimiser state. A checkpoint from before this layout holds the states
  inline in ``state.pt``; :func:`load_checkpoint` reads both.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ray_diloco.components.storage import atomic_write, replace_dir, storage_reason, upload_file
from ray_diloco.errors import CheckpointError

_STEP = re.compile(r"^step_(\d{6,})$")
STATE_FILE = "state.pt"
OUTER_FILE = "outer.pt"
#: A token the job writes into a checkpoint's temporary directory: writers that do not read it
#: there do not share the run directory (their state goes through the job).
MARKER = ".writers"
REQUIRED_KEYS = ("format", "outer_step", "config", "counters", "outer", "workers", "corpus_fingerprint")


def checkpoint_dir(run_dir: Path) -> Path:
    """``RUN_DIR/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(outer_step, path)``, oldest first (temporary dirs are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _tensors_only(obj: Any) -> Any:
    """Numpy arrays become torch tensors (recursively), so the file loads with ``weights_only``."""
    if isinstance(obj, np.ndarray):  # object-store arrays are read-only: copied; others shared
        shared = obj.flags.writeable and obj.flags.c_contiguous and obj.dtype.isnative
        return torch.from_numpy(obj if shared else np.array(obj, dtype=obj.dtype.newbyteorder("="), order="C"))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _tensors_only(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors_only(v) for v in obj)
    return obj


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker_file(replica: int, rank: int) -> str:
    """The file name of worker ``(replica, rank)``'s state in a checkpoint directory."""
    return f"worker-{replica}-{rank}.pt"


def write_state_file(path: Path, state: dict[str, Any]) -> int:
    """Write one process's part of a checkpoint to ``path`` atomically (a temporary name in the
    same directory, fsync, rename). Returns the file's size in bytes.

    Raises:
        CheckpointError: it cannot be written (disk full, permissions); the temporary file is removed.
    """
    try:
        return _write(Path(path), state)
    except Exception as e:  # noqa: BLE001 - disk full, permissions, unpicklable state
        raise CheckpointError(f"checkpoint file {path}: cannot be written ({_reason(e)})") from None


def write_own_file(
    path: Path, token: str | None, state: Callable[[], dict[str, Any]], upload: str | None, node: str
) -> dict[str, Any]:
    """The one way a process writes its own part of a checkpoint (a replica worker's
    ``worker-R-K.pt``, the outer side's ``outer.pt``): when this process sees the checkpoint's
    temporary directory (its ``token`` marker, :func:`sees_marker`), ``state()`` with
    ``checkpoint_id`` ``token`` written to ``path`` atomically, then with ``upload`` (the file's
    URI in ``run.storage_path``) copied there from here.

    Returns ``{"file", "bytes", "node"}`` (+ ``"uploaded"``, or ``"upload_error"``: the job's
    mirror uploads it); ``{"unseen": True, "node"}`` when this node does not see the directory
    (``state`` is not called: the job fetches the state and writes it); ``{"error": line}``
    when the file cannot be written (disk full, permissions): the job fails the checkpoint with
    that line and removes its temporary directory; the process and the run go on. ``node``: the
    Ray node id of the caller (for the job's messages)."""
    path = Path(path)
    if token is not None and not sees_marker(path.parent, token):
        return {"unseen": True, "node": node}
    try:
        size = write_state_file(path, {**state(), "checkpoint_id": token})
    except CheckpointError as e:
        return {"error": str(e)}
    info: dict[str, Any] = {"file": path.name, "bytes": size, "node": node}
    if upload:
        problem = upload_file(path, upload)
        info.update({"uploaded": True} if problem is None else {"upload_error": problem})
    return info


def _reason(e: BaseException) -> str:
    """Why a write failed (:func:`~ray_diloco.components.storage.storage_reason`), at most 160 characters."""
    return storage_reason(e, limit=160)


def _write(path: Path, state: dict[str, Any]) -> int:
    atomic_write(path, lambda f: torch.save(_tensors_only(state), f), durable=True)
    return path.stat().st_size


def read_state_file(path: Path) -> dict[str, Any]:
    """One state file of a checkpoint (``weights_only``: a checkpoint is data, loading it never runs
    code); the flat fp32 fragments (``global``, ``local``) come back as numpy arrays.

    Raises:
        CheckpointError: missing, truncated or otherwise unreadable file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: file not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path}: corrupt or unreadable ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: not a ray-diloco checkpoint")
    for key in ("global", "local"):
        if key in state:
            state[key] = [t.numpy() for t in state[key]]
    return state


def begin_checkpoint(run_dir: Path, outer_step: int) -> Path:
    """A new, empty temporary directory for the checkpoint of ``outer_step``, as an absolute path
    (the other processes' working directories differ from this one's): every writer puts its
    file there; :func:`finish_checkpoint` makes it the checkpoint.

    Raises:
        CheckpointError: it cannot be made (permissions, disk full)."""
    root = checkpoint_dir(run_dir).resolve()
    tmp = root / f".tmp-step_{outer_step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint {root / f'step_{outer_step:06d}'}: cannot be written ({_reason(e)})"
        ) from None
    return tmp


def place_marker(directory: Path) -> str:
    """Write a new random token into ``directory/.writers`` and return it: a process that reads the
    same token there (:func:`sees_marker`) sees this directory (a shared file system)."""
    token = uuid.uuid4().hex
    (Path(directory) / MARKER).write_text(token)
    return token


def sees_marker(directory: Path | str, token: str) -> bool:
    """Whether this process sees ``directory`` with the token of :func:`place_marker` in it."""
    try:
        return (Path(directory) / MARKER).read_text() == token
    except OSError:
        return False


def visible_file(entry: dict[str, Any] | str) -> bool:
    """Whether this process sees the file a checkpoint names (``{"file": path, "bytes": size}``,
    or a path): it exists with the recorded size."""
    path, size = (entry, None) if isinstance(entry, str) else (entry["file"], entry.get("bytes"))
    path = Path(path)
    return path.is_file() and (size is None or path.stat().st_size == size)


def read_own_state(entry: dict[str, Any] | str, checkpoint_id: str | None) -> dict[str, Any] | None:
    """The state in a checkpoint's file (``{"file", "bytes"}`` or a path), or None when this
    process does not see it or it belongs to another checkpoint (its ``checkpoint_id``: a stale
    file of the same name in another directory); the caller then gets the state another way.

    Raises:
        CheckpointError: the file is unreadable."""
    if not visible_file(entry):
        return None
    state = read_state_file(Path(entry if isinstance(entry, str) else entry["file"]))
    if checkpoint_id is not None and state.get("checkpoint_id", checkpoint_id) != checkpoint_id:
        return None
    return state


def finish_checkpoint(run_dir: Path, outer_step: int, tmp: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``state.pt`` into ``tmp`` (holding the other processes' files), then
    rename ``tmp`` to the checkpoint of ``outer_step``; prune to the last ``keep``.

    Raises:
        CheckpointError: when it cannot be written (the temporary directory is removed, older
            checkpoints are untouched).
    """
    root = checkpoint_dir(run_dir)
    final = root / f"step_{outer_step:06d}"
    named = {
        e["file"]
        for e in [state.get("outer"), *state.get("workers", {}).values()]
        if isinstance(e, dict) and "file" in e
    }
    for p in tmp.iterdir():  # the marker, files of replicas lost meanwhile, a killed writer's temporary
        if p.name not in named:
            p.unlink() if not p.is_dir() else shutil.rmtree(p, ignore_errors=True)
    try:
        _write(tmp / STATE_FILE, state)
        _fsync_dir(tmp)
    except Exception as e:  # disk full, permissions, unpicklable state: older checkpoints stay as they were
        shutil.rmtree(tmp, ignore_errors=True)
        free_mb = shutil.disk_usage(root).free / 2**20
        raise CheckpointError(
            f"checkpoint {final}: cannot be written ({_reason(e)}; {free_mb:,.0f} MiB free on that disk)"
        ) from None
    replace_dir(tmp, final, root / f".old-step_{outer_step:06d}-{os.getpid()}")  # a re-saved step: whole
    _fsync_dir(root)
    for _, p in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def save_checkpoint(run_dir: Path, outer_step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (every state inline) atomically as the checkpoint of ``outer_step``; prune
    to the last ``keep``.

    Raises:
        CheckpointError: when it cannot be written (older checkpoints are untouched).
    """
    return finish_checkpoint(run_dir, outer_step, begin_checkpoint(run_dir, outer_step), state, keep)


def lock_dir(directory: Path, what: str):
    """Take ``directory``'s exclusive lock (``DIR/.lock``, holding the owner's pid) for this
    process's lifetime. Returns the open lock file (keep it open; closing it releases the lock).

    Raises:
        CheckpointError: ``"{what}: in use by another ray-diloco process (pid N)"``.
    """
    import fcntl

    f = open(Path(directory) / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise CheckpointError(
            f"{what}: in use by another ray-diloco process" + (f" (pid {holder})" if holder.isdigit() else "")
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def lock_run_dir(run_dir: Path):
    """:func:`lock_dir` for a run directory (a run or a resume already using it is refused)."""
    return lock_dir(run_dir, f"run directory {run_dir}")


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete temporary checkpoint directories a killed process left (call with the run lock held)."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-step_", ".old-step_")):
                shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, lazy: bool = False) -> dict[str, Any]:
    """Load one checkpoint directory (or its ``state.pt``). The states written by the workers and
    the driver are read too; with ``lazy`` they stay ``{"file": absolute path, "bytes": size}`` (a
    resume: each process reads its own file, the job's process never holds them).

    Raises:
        CheckpointError: missing, truncated or otherwise unreadable file.
    """
    path = Path(path)
    f = path / STATE_FILE if path.is_dir() else path
    state = read_state_file(f)
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {f}: not a complete ray-diloco checkpoint (missing {', '.join(missing)})")

    def resolve(entry: Any) -> Any:
        if isinstance(entry, dict) and "file" in entry:
            where = (f.parent / entry["file"]).resolve()
            if not where.is_file():
                raise CheckpointError(f"checkpoint {where}: file not found")
            return {**entry, "file": str(where)} if lazy else read_state_file(where)
        return entry

    state["outer"] = resolve(state["outer"])
    state["workers"] = {k: resolve(w) for k, w in state["workers"].items()}
    # inline states (a checkpoint from before the per-process files): fragments as numpy
    if state["outer"] is not None and "global" in state["outer"]:
        state["outer"]["global"] = [np.asarray(t) for t in state["outer"]["global"]]
    for w in state["workers"].values():
        if "local" in w:
            w["local"] = [np.asarray(t) for t in w["local"]]
    return state


def global_params(state: dict[str, Any]) -> list[np.ndarray]:
    """A checkpoint's global parameters, fp32 ``[numel_p]`` per fragment (DP: rank 0's parameters).
    An FSDP run's outer state holds W parts per fragment (``exchange_units`` W, fragment specs in
    ``fragments``): they are joined (``core.shards.join_rank_parts``)."""
    if not state.get("outer"):
        w0 = state["workers"][(0, 0)]
        return read_state_file(Path(w0["file"]))["local"] if "file" in w0 else w0["local"]
    if "file" in state["outer"]:  # a lazily loaded checkpoint: only outer.pt is read
        state = {**state, "outer": read_state_file(Path(state["outer"]["file"]))}
    from ray_diloco.core.fragments import Fragment, ParamSpec
    from ray_diloco.core.shards import join_units

    frags = [
        Fragment(i, tuple(ParamSpec(n, tuple(shape)) for n, shape in specs))
        for i, specs in enumerate(state.get("fragments", []))
    ]
    return join_units(state["outer"]["global"], frags, int(state.get("exchange_units") or 1))


def checkpoint_config(state: dict[str, Any]) -> Any:
    """The :class:`~ray_diloco.config.Config` a checkpoint was trained with, its model shape
    pinned: a checkpoint written before runs recorded the shape gets the presets of that time
    (:func:`ray_diloco.models.transformer.pin_model_fields`)."""
    from ray_diloco.config import load_config
    from ray_diloco.models.transformer import pin_model_fields

    cfg = load_config(state["config"], validate=False)
    pin_model_fields(cfg.model, recorded_before_pinning=True)
    return cfg


def latest_checkpoint(run_dir: Path) -> tuple[int, Path]:
    """The newest complete checkpoint of a run directory.

    Raises:
        CheckpointError: when the directory or its checkpoints are missing.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run directory {run_dir}: not found")
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise CheckpointError(f"run directory {run_dir}: no checkpoints in {checkpoint_dir(run_dir)}")
    return ckpts[-1]
