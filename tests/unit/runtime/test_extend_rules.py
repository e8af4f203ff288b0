"""Extending a finished run: what --resume with more steps refuses (no Ray)."""

from __future__ import annotations

import pytest
from helpers import tiny_overrides, tree


def test_extending_a_run_that_ends_part_way_through_an_outer_step_is_refused(tmp_path):
    """Outer step k covers inner steps [(k-1)H, kH): a checkpoint at T = 14 with H = 8 cannot be
    continued to 30 without skipping or re-keying steps 14-15, so --resume refuses it with one
    line and leaves the run as it was; resuming it unchanged is still allowed."""
    from ray_diloco.components.checkpoint import save_checkpoint
    from ray_diloco.config import load_config
    from ray_diloco.errors import ConfigError
    from ray_diloco.runtime.launcher import prepare

    cfg = load_config(tiny_overrides(tmp_path, run__name="odd", run__steps=14, diloco__H=8))
    run_dir = tmp_path / "runs" / "odd"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    state = {"format": 1, "outer_step": 2, "config": cfg.to_dict(), "counters": {"inner_step": 14},
             "outer": None, "workers": {}, "corpus_fingerprint": ""}
    save_checkpoint(run_dir, 2, state, keep=1)
    before = tree(run_dir)
    with pytest.raises(ConfigError, match=r"run.steps = 30: the checkpoint ends at inner step 14, part way through "
                                          r"an outer step of diloco.H = 8 .* cannot be extended"):
        prepare(resume=run_dir, overrides=["run.steps=30"])
    assert tree(run_dir) == before
    assert prepare(resume=run_dir)[2]["counters"]["inner_step"] == 14
