"""The project's temp-then-renames, all in ``components.storage``: a file written whole or not at
all, with the permissions a plain write would give it (``atomic_write``); a directory whose first
writer wins (``publish_dir``)."""

from __future__ import annotations

import os
import stat

import pytest

from ray_diloco.components.storage import atomic_write, publish_dir, write_text


def test_a_file_is_written_whole_with_the_umasks_mode_and_a_failure_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "summary.json"
    write_text(path, "old")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as open() makes it, readable by others
    with pytest.raises(ZeroDivisionError):
        atomic_write(path, lambda f: (f.write(b"half"), 1 / 0))
    assert path.read_text() == "old" and os.listdir(path.parent) == ["summary.json"]  # no temporary left
    atomic_write(path, lambda f: f.write(b"new"), durable=True)
    assert path.read_text() == "new" and os.listdir(path.parent) == ["summary.json"]
    with pytest.raises(OSError, match="Is a directory"):
        write_text(tmp_path / "sub", "x")


def test_a_directory_is_published_by_its_first_writer_and_the_others_use_it(tmp_path):
    final = tmp_path / "entry"
    for name, text in (("a", "first"), ("b", "second")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    assert publish_dir(tmp_path / "a", final, marker="manifest.json")
    assert not publish_dir(tmp_path / "b", final, marker="manifest.json")  # lost: its copy removed
    assert (final / "manifest.json").read_text() == "first" and sorted(os.listdir(tmp_path)) == ["entry"]
    unfinished = tmp_path / "half"  # a directory without the marker is no finished entry: not used
    unfinished.mkdir()
    (unfinished / "x").write_text("x")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text("third")
    with pytest.raises(OSError):
        publish_dir(tmp_path / "c", unfinished, marker="manifest.json")
    assert (tmp_path / "c" / "manifest.json").is_file()  # kept: the caller removes it


def test_storage_errors_are_said_in_words_by_every_writer():
    from ray_diloco.components.storage import storage_reason

    assert storage_reason(OSError(28, "No space left on device")) == "disk full"
    assert storage_reason(PermissionError(13, "Permission denied")) == "permission denied"
    assert storage_reason(OSError(30, "Read-only file system")) == "read-only file system"
    assert storage_reason(ValueError("bad bucket name\nmore")) == "bad bucket name"
    assert storage_reason(OSError()) == "OSError"
