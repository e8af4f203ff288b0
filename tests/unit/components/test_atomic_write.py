"""The one temp-then-rename (``components.storage.atomic_write``): a file written whole or not at
all, with the permissions a plain write would give it."""

from __future__ import annotations

import os
import stat

import pytest

from ray_diloco.components.storage import atomic_write, write_text


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
