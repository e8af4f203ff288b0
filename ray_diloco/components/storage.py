"""The storage layer: local paths and URIs (``s3://``, ``gs://``, ``file://`` or any scheme pyarrow
or fsspec knows) read and written the same way, through pyarrow's filesystem interface (fsspec's
filesystems wrapped into it for the schemes pyarrow lacks: :func:`filesystem`).

- Whole or not at all, every temp-then-rename of the project: a file (:func:`atomic_write`;
  :func:`put_file` to a URI), a directory replacing another (:func:`replace_dir`: checkpoints,
  the export), a directory whose first writer wins (:func:`publish_dir`: the data cache, a
  downloaded checkpoint).
- A directory anywhere (:class:`Location`: the token store, ``prepare``): read, write, list,
  delete, copy to and from a local directory, every error one line naming the option.
- Small files anywhere: :func:`read_text`, :func:`write_bytes`, :func:`write_text`;
  :func:`upload_file` from a worker's node.

The run mirror built on it is ``components.mirror``."""

from __future__ import annotations

import os
import posixpath
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, TypeGuard

from ray_diloco.errors import ConfigError, DataError
from ray_diloco.log import error_line

#: Storage errors said in words (``errno`` -> reason), whatever the filesystem that raised them.
_ERRNO_REASONS = {28: "disk full", 13: "permission denied", 30: "read-only file system", 122: "quota exceeded"}


def storage_reason(e: BaseException, limit: int = 300) -> str:
    """Why a storage operation failed, for the one-line errors and notes of every writer and
    reader (checkpoints, the token store, the mirror, the data cache): a full disk, a denied
    permission, a read-only file system or an exceeded quota in those words, else the error's
    first line (at most ``limit`` characters)."""
    reason = _ERRNO_REASONS.get(getattr(e, "errno", None) or 0)
    return reason if reason is not None else error_line(e, typed=False, limit=limit)


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


def put_file(fs: Any, local: Path, remote: str) -> None:
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
        put_file(fs, Path(local), path)
        return None
    except Exception as e:  # noqa: BLE001 - any client error: the mirror uploads the file instead
        return storage_reason(e)


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


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], durable: bool = False) -> None:
    """Write a local file whole or not at all: ``write(f)`` fills a temporary file in the same
    directory (created with the parents), which then replaces ``path`` (``os.replace``: a reader
    sees the old file or the new one, never a part); with ``durable`` it is fsynced first (a
    checkpoint survives a power cut). The project's one temp-then-rename.

    Raises:
        OSError: naming ``path`` (not the temporary file), nothing left behind; ``is a
            directory`` or ``a parent is not a directory`` when the path cannot be a file."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise OSError(21, "Is a directory (give a file path)", str(p))
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        # a new name (O_EXCL), made with the process's umask as the file itself would be (mkstemp's
        # 0600 would keep a shared run directory's files from other readers)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "xb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:  # name the file asked for, not the temporary one
        why = (
            "a parent is not a directory"
            if isinstance(e, (FileExistsError, NotADirectoryError))
            else (e.strerror or str(e))
        )
        raise OSError(e.errno, why, str(p)) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def remove_path(path: Path) -> None:
    """Delete a directory tree, a file or a link (not what a link points to); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_dir(tmp: Path, final: Path, aside: Path) -> None:
    """Put the finished directory ``tmp`` in place of ``final`` whole (the directory form of
    :func:`atomic_write`): the old ``final`` (if any) is renamed to ``aside``, ``tmp`` to
    ``final``, then ``aside`` is removed; a kill leaves the old directory or the new one (and
    ``aside``, which the caller's clean-up recognises by its name).

    Raises:
        OSError: a rename failed (the old directory is back in place when the second one did)."""
    remove_path(aside)
    moved = final.exists() or final.is_symlink()
    if moved:
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError:
        if moved:
            os.rename(aside, final)
        raise
    remove_path(aside)


def publish_dir(tmp: Path, final: Path, marker: str | None = None) -> bool:
    """Rename the finished directory ``tmp`` to ``final`` unless another writer's is there already
    (two runs building the same cache entry together: the first rename wins, the loser's ``tmp`` is
    removed and it uses the winner's). ``marker``: a file a finished ``final`` holds (a directory
    without it is not another writer's finished one). Returns whether this ``tmp`` was published.

    Raises:
        OSError: the rename failed and no finished ``final`` is there (``tmp`` is kept)."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        if not final.is_dir() or (marker is not None and not (final / marker).is_file()):
            raise
    remove_path(tmp)
    return False


def write_bytes(uri_or_path: str | Path, data: bytes | memoryview) -> None:
    """Write a small file to a local path (atomically: :func:`atomic_write`) or a URI (one PUT)."""
    if not is_uri(str(uri_or_path)):
        atomic_write(uri_or_path, lambda f: f.write(data))
        return
    fs, path = filesystem(str(uri_or_path))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(uri_or_path: str | Path, text: str) -> None:
    """:func:`write_bytes` of UTF-8 text."""
    write_bytes(uri_or_path, text.encode())


class Location:
    """A directory at a local path or a URI (:func:`filesystem`), its files read, written
    (atomically), listed, deleted and copied to and from a local directory; every storage error
    becomes one :class:`~ray_diloco.errors.DataError` line naming ``field`` (the option that gave
    ``where``), its value and the file.

    Raises:
        DataError: no filesystem for the URI (at construction)."""

    def __init__(self, where: str, field: str = "data.prepared"):
        self.where, self.field, self.remote = str(where), field, is_uri(str(where))
        if self.remote:
            try:
                self.fs, self.root = filesystem(self.where)
            except ConfigError as e:
                raise DataError(f"{field} = {where!r}: {e.problems[0].split(': ', 1)[-1]}") from None
        else:
            self.fs, self.root = None, str(Path(self.where).expanduser())

    def path(self, name: str) -> str:
        """The file ``name`` inside the store (a local path or a path in the filesystem)."""
        return posixpath.join(self.root, name) if self.remote else os.path.join(self.root, name)

    def read_bytes(self, name: str) -> bytes | None:
        """The file's bytes, None when it does not exist."""
        try:
            if not self.remote:
                return Path(self.path(name)).read_bytes()
            with self.fs.open_input_stream(self.path(name)) as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if self.remote and self._missing(name):  # the filesystem says so: no message matching
                return None
            raise DataError(f"{self.field} = {self.where!r}: cannot read {name} ({storage_reason(e)})") from None

    def _missing(self, name: str) -> bool:
        """Whether the remote file ``name`` (or its bucket) does not exist, asked of the filesystem."""
        from pyarrow.fs import FileType

        try:
            return bool(self.fs.get_file_info(self.path(name)).type == FileType.NotFound)
        except FileNotFoundError:
            return True
        except OSError as e:  # a bucket that does not exist is reported as an error by some stores
            return getattr(e, "errno", None) == 2

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Write ``name`` atomically (temporary name then rename; one object put when remote).

        Raises:
            DataError: the disk is full or the store cannot be written (the temporary file is removed).
        """
        try:
            if self.remote:
                self.fs.create_dir(posixpath.dirname(self.path(name)), recursive=True)
                with self.fs.open_output_stream(self.path(name)) as f:
                    f.write(data)
                return
            atomic_write(self.path(name), lambda f: f.write(data))
        except OSError as e:
            reason = storage_reason(e)
            raise DataError(
                f"{self.field} = {self.where!r}: cannot write {name} ({reason}); finished shards are "
                "kept and a rerun continues"
            ) from None

    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""
        if self.remote:
            try:
                self.fs.delete_file(self.path(name))
            except OSError:
                pass
        else:
            Path(self.path(name)).unlink(missing_ok=True)

    def put_dir(self, local: Path, name: str) -> None:
        """Copy the files of the local directory ``local`` to ``name/`` (each atomically)."""
        for f in sorted(Path(local).iterdir()):
            if f.is_file():
                self.write_bytes(f"{name}/{f.name}", f.read_bytes())

    def get_dir(self, name: str, files: list[str], local: Path) -> Path:
        """Copy ``name/FILE`` for each of ``files`` that exists into the local directory ``local``."""
        local.mkdir(parents=True, exist_ok=True)
        for fname in files:
            data = self.read_bytes(f"{name}/{fname}")
            if data is not None:
                (local / fname).write_bytes(data)
        return local
