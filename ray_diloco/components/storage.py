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
import os
import posixpath
from pathlib import Path
from typing import Any, TypeGuard

from ray_diloco.errors import CheckpointError, ConfigError
from ray_diloco.log import error_line

logger = logging.getLogger(__name__)

#: Files and folders mirrored after every checkpoint (besides the checkpoints themselves).
RUN_FILES = ("config.yaml", "metrics.jsonl", "wandb_id.txt", "tokenizer")
#: Mirrored once the run has finished.
FINAL_FILES = ("summary.json", "final")


def is_uri(path: str | None) -> TypeGuard[str]:
    """True for ``scheme://...`` (a filesystem other than a plain local path)."""
    return bool(path) and "://" in str(path)


def filesystem(uri: str) -> tuple[Any, str]:
    """``(pyarrow.fs.FileSystem, path inside it)`` for ``uri``: pyarrow's own filesystems
    (local ``file://``, ``s3://``, ``gs://``, ``hdfs://``) first, else fsspec's (``memory://``,
    ``az://``, ...) wrapped for pyarrow.

    Raises:
        ConfigError: the scheme is unknown to both, or its client library is missing.
    """
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception:  # ArrowInvalid / ArrowNotImplementedError for schemes pyarrow lacks
        pass
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise ConfigError(
            [
                f"run.storage_path = {uri!r}: no filesystem for this URI ({error_line(e, typed=False)}); "
                "use a local path, s3://, gs://, file:// or a scheme fsspec knows"
            ]
        ) from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def join_uri(storage_path: str, name: str) -> str:
    """``storage_path/name`` (a local path or a URI); a query (``s3://b/runs?endpoint_override=...``,
    the options pyarrow reads from it) stays at the end."""
    base, sep, query = storage_path.partition("?")
    return base.rstrip("/") + "/" + name + sep + query


def split_uri(uri: str) -> tuple[str, str]:
    """The inverse of :func:`join_uri`: ``(storage_path, name)`` of ``storage_path/name[?query]``."""
    base, sep, query = uri.partition("?")
    parent, _, name = base.rstrip("/").rpartition("/")
    return parent + sep + query, name


def _put_file(fs: Any, local: Path, remote: str) -> None:
    """Copy ``local`` to ``remote``, whole or not at all: on a file system that shows a file while
    it is written (``file://``) under a temporary name, then renamed (a killed upload leaves no
    half ``state.pt`` that a resume would take); object stores (S3, GCS) show an object only
    once its upload completed."""
    import pyarrow.fs as pafs

    fs.create_dir(posixpath.dirname(remote), recursive=True)
    atomic = isinstance(fs, pafs.LocalFileSystem)
    target = f"{posixpath.dirname(remote)}/.{posixpath.basename(remote)}.part" if atomic else remote
    with open(local, "rb") as src, fs.open_output_stream(target) as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    if atomic:
        fs.move(target, remote)


def upload_file(local: Path, uri: str) -> str | None:
    """Copy the file ``local`` to ``uri`` (a file's URI, :func:`join_uri` of a storage path) from
    this process, in 8 MiB chunks; None when done, else the one-line reason it could not be (no
    client library or credentials on this node, the network): the caller leaves the file to the
    job's :class:`Mirror`."""
    try:
        fs, path = filesystem(uri)
        _put_file(fs, Path(local), path)
        return None
    except Exception as e:  # noqa: BLE001 - any client error: the mirror uploads the file instead
        return error_line(e, limit=300)


def _put(fs: Any, local: Path, remote: str) -> None:
    if local.is_dir():
        for p in sorted(local.rglob("*")):
            if p.is_file():
                _put_file(fs, p, remote + "/" + p.relative_to(local).as_posix())
    elif local.is_file():
        _put_file(fs, local, remote)


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
            logger.warning(f"warning: could not mirror the run to {self.uri} ({error_line(e)})")
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
            tmp.rename(target)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"--resume {uri}: cannot read it ({error_line(e)})") from None
    return local


def _get_file(fs: Any, remote: str, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(local.name + ".part")
    with fs.open_input_stream(remote) as src, open(tmp, "wb") as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
    os.replace(tmp, local)


def read_text(uri_or_path: str) -> str | None:
    """A small text file from a local path or a URI; None when it does not exist."""
    if not is_uri(uri_or_path):
        p = Path(uri_or_path).expanduser()
        return p.read_text() if p.is_file() else None
    fs, path = filesystem(uri_or_path)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except (OSError, FileNotFoundError):
        return None


def write_bytes(uri_or_path: str, data: bytes) -> None:
    """Write a small file to a local path (atomically: temp file + rename) or a URI (one PUT)."""
    if not is_uri(uri_or_path):
        p = Path(uri_or_path).expanduser()
        if p.is_dir():
            raise OSError(21, "Is a directory (give a file path)", str(p))
        tmp = p.with_name(p.name + ".tmp")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, p)
        except OSError as e:  # name the file asked for, not the temporary one, and leave nothing behind
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            why = (
                "a parent is not a directory"
                if isinstance(e, (FileExistsError, NotADirectoryError))
                else (e.strerror or str(e))
            )
            raise OSError(e.errno, why, str(p)) from None
        return
    fs, path = filesystem(uri_or_path)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(uri_or_path: str, text: str) -> None:
    """:func:`write_bytes` of UTF-8 text."""
    write_bytes(uri_or_path, text.encode())
