"""Run directories on cloud or shared storage (``run.storage_path``), the way Ray Train does it.

A run always writes to a local directory first (``run.output_dir/NAME``: checkpoints are
written there atomically). When ``run.storage_path`` is a URI (``s3://bucket/runs``,
``gs://bucket/runs``, ``file:///mnt/shared/runs`` or any other scheme pyarrow or fsspec knows),
the run directory is mirrored to ``storage_path/NAME``:

- after every checkpoint: ``config.yaml``, ``metrics.jsonl``, the tokenizer, the W&B run id and
  each new checkpoint (the workers' and the driver's files first, ``state.pt`` last: a checkpoint
  without ``state.pt`` there is never resumed from, and one uploaded again loses its ``state.pt``
  first); checkpoints pruned locally are deleted there too;
- at the end: ``summary.json`` and the exported model (``final/``).

``ray-diloco train --resume s3://bucket/runs/NAME`` downloads what a resume needs (config,
tokenizer, metrics, newest checkpoint) into ``run.output_dir/NAME`` and continues; a trial of a
sweep whose storage is remote does the same when Tune restarts it on another node.

A plain local path in ``run.storage_path`` is simply where run directories go (no mirror).
"""

from __future__ import annotations

import logging
import posixpath
from pathlib import Path
from typing import Any, BinaryIO

from ray_diloco.components.storage import atomic_write, filesystem, join_uri, publish_dir, put_file, storage_reason
from ray_diloco.errors import CheckpointError

logger = logging.getLogger(__name__)

#: Files and folders mirrored after every checkpoint (besides the checkpoints themselves).
RUN_FILES = ("config.yaml", "metrics.jsonl", "wandb_id.txt", "tokenizer")
#: Mirrored once the run has finished.
FINAL_FILES = ("summary.json", "final")


def _put(fs: Any, local: Path, remote: str) -> None:
    if local.is_dir():
        for p in sorted(local.rglob("*")):
            if p.is_file():
                put_file(fs, p, remote + "/" + p.relative_to(local).as_posix())
    elif local.is_file():
        put_file(fs, local, remote)


def _listing(fs: Any, path: str, recursive: bool = False) -> list[Any]:
    import pyarrow.fs as pafs

    try:
        return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=recursive))
    except (OSError, FileNotFoundError):
        return []


class Mirror:
    """Copies a local run directory to ``storage_path/NAME`` (see the module docstring).

    Upload errors are reported once per call on stderr and never stop training: the local run
    directory stays complete, and the next call uploads what is missing.
    """

    def __init__(self, run_dir: Path, storage_path: str, keep: int | None = None):
        self.run_dir = Path(run_dir)
        self.keep = keep  # run.keep_checkpoints: the storage keeps the newest this many (None: those kept locally)
        self.uri = join_uri(storage_path, self.run_dir.name)
        self.fs, self.path = filesystem(self.uri)
        self._uploaded: set[str] = set()
        self._by_writers: dict[str, set[str]] = {}  # checkpoint name -> files its writers uploaded

    def checkpoint_uri(self, name: str) -> str | None:
        """The storage URI of checkpoint ``name`` (``step_NNNNNN``), where its writers upload their
        files; a stored ``state.pt`` of that name (a checkpoint written again) is deleted first,
        so the stored checkpoint is not complete until :meth:`sync` uploads the new one. None for a
        storage only this process sees (``memory://``): :meth:`sync` uploads every file."""
        import pyarrow.fs as pafs

        from ray_diloco.components.checkpoint import STATE_FILE

        remote = f"{self.path}/checkpoints/{name}/{STATE_FILE}"
        try:
            if self.fs.get_file_info(remote).type == pafs.FileType.File:
                self.fs.delete_file(remote)
        except Exception:  # noqa: BLE001 - unreachable storage: sync reports it
            pass
        self._uploaded.discard(name)
        if self.uri.split("://", 1)[0] == "memory":
            return None
        return join_uri(self.uri, f"checkpoints/{name}")

    def uploaded_by_writers(self, name: str, files: set[str]) -> None:
        """Files of checkpoint ``name`` its writers uploaded themselves: :meth:`sync` skips them."""
        self._by_writers[name] = set(files)

    def sync(self, final: bool = False) -> bool:
        """Upload new checkpoints and the run files (and, when ``final``, the summary and the
        exported model); delete checkpoints no longer kept locally. Returns True on success."""
        import pyarrow.fs as pafs

        from ray_diloco.components.checkpoint import STATE_FILE, list_checkpoints

        try:
            local = {p.name: p for _, p in list_checkpoints(self.run_dir)}
            for name, p in local.items():  # oldest first: the newest is written last
                if name not in self._uploaded:  # the workers' and driver's files, then state.pt: it marks it complete
                    remote = f"{self.path}/checkpoints/{name}"
                    if self.fs.get_file_info(f"{remote}/{STATE_FILE}").type == pafs.FileType.File:
                        self.fs.delete_file(f"{remote}/{STATE_FILE}")  # re-uploaded: not complete until the end
                    done = self._by_writers.pop(name, set())
                    for f in sorted(
                        (f for f in p.iterdir() if not f.name.startswith(".") and f.name not in done),
                        key=lambda f: f.name == STATE_FILE,
                    ):
                        _put(self.fs, f, f"{remote}/{f.name}")
                    self._uploaded.add(name)
            stored = [i for i in _listing(self.fs, f"{self.path}/checkpoints") if i.base_name.startswith("step_")]
            # with keep: the newest `keep` of stored and local (a resume elsewhere fetched only the
            # newest: the older stored ones stay); without: what the run directory still holds
            kept = set(sorted(set(local) | {i.base_name for i in stored})[-self.keep :]) if self.keep else set(local)
            for info in stored:
                if info.base_name not in kept:
                    self.fs.delete_dir(info.path)
                    self._uploaded.discard(info.base_name)
            for name in RUN_FILES + (FINAL_FILES if final else ()):
                _put(self.fs, self.run_dir / name, f"{self.path}/{name}")
            return True
        except Exception as e:  # network, permissions, quota: keep training; the local copy is whole
            logger.warning(f"warning: could not mirror the run to {self.uri} ({storage_reason(e)})")
            return False


def download_run(uri: str, output_dir: str | Path) -> Path:
    """Fetch what a resume needs from a mirrored run directory ``uri`` into
    ``output_dir/NAME``: config, tokenizer, metrics, W&B id and the newest checkpoint. Files
    already there are replaced only by newer checkpoints. Returns the local run directory.

    Raises:
        CheckpointError: nothing resumable at ``uri`` (no config.yaml or no checkpoint).
    """
    import pyarrow.fs as pafs

    from ray_diloco.components.checkpoint import STATE_FILE, list_checkpoints

    fs, path = filesystem(uri)
    name = posixpath.basename(path.rstrip("/"))
    local = Path(output_dir).expanduser() / name
    try:
        if fs.get_file_info(f"{path}/config.yaml").type != pafs.FileType.File:
            raise CheckpointError(f"--resume {uri}: not a run directory (no config.yaml there)")
        steps = sorted(
            i.base_name
            for i in _listing(fs, f"{path}/checkpoints")
            if i.base_name.startswith("step_") and fs.get_file_info(f"{i.path}/{STATE_FILE}").type == pafs.FileType.File
        )
        if not steps:
            raise CheckpointError(f"--resume {uri}: no complete checkpoint there")
        newest = steps[-1]
        have = {p.name for _, p in list_checkpoints(local)}
        local.mkdir(parents=True, exist_ok=True)
        for item in RUN_FILES:
            info = fs.get_file_info(f"{path}/{item}")
            if info.type == pafs.FileType.Directory:
                for sub in _listing(fs, f"{path}/{item}", recursive=True):
                    if sub.type == pafs.FileType.File:
                        _get_file(fs, sub.path, local / item / sub.path[len(f"{path}/{item}/") :])
            elif info.type == pafs.FileType.File:
                _get_file(fs, f"{path}/{item}", local / item)
        if newest not in have:
            target = local / "checkpoints" / newest
            tmp = local / "checkpoints" / f".tmp-{newest}"  # removed by remove_partial_checkpoints if killed
            tmp.mkdir(parents=True, exist_ok=True)
            for sub in _listing(fs, f"{path}/checkpoints/{newest}"):  # state.pt and the processes' files
                if sub.type == pafs.FileType.File and not sub.base_name.startswith("."):  # not a killed upload's part
                    _get_file(fs, sub.path, tmp / sub.base_name)
            publish_dir(tmp, target, marker=STATE_FILE)  # another process's download may win
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"--resume {uri}: cannot read it ({storage_reason(e)})") from None
    return local


def _get_file(fs: Any, remote: str, local: Path) -> None:
    def copy(dst: BinaryIO) -> None:
        with fs.open_input_stream(remote) as src:
            while chunk := src.read(8 << 20):
                dst.write(chunk)

    atomic_write(local, copy)
