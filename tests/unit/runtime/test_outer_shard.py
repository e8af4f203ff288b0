"""The outer-optimiser shard (runtime/outer_shards.py's OuterShard) without Ray: its maths runs off the
actor's event loop, so the driver answers pings, joins and other replicas' messages while it
decodes pseudo-gradients and steps a large fragment (the same property on a real actor, counted:
integration/test_elastic.py::test_the_driver_answers_pings_and_joins_while_it_steps_a_large_fragment)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch

from ray_diloco.config import load_config
from ray_diloco.core.quantize import quantize_message
from ray_diloco.runtime import outer_shards as D


def test_decoding_and_the_outer_step_run_off_the_event_loop(monkeypatch):
    shard = D.OuterShard(load_config({"diloco": {"replicas": 2}, "inner": {"global_batch": 4}}).to_dict())
    shard.set_global([np.zeros(10, np.float32)])
    ran: dict[str, threading.Thread] = {}

    def decode(message):  # stands in for the decode and finiteness check of a pseudo-gradient
        ran["decode"] = threading.current_thread()
        return np.ones(10, np.float32), 1.0

    def step(fragment, mean, average_only):  # stands in for step_ordered and the reply's encoding
        ran["step"] = threading.current_thread()
        return None, 0, 0.0, 1

    monkeypatch.setattr(D, "_decode_and_check", decode)
    monkeypatch.setattr(shard, "_step", step)

    async def round_() -> threading.Thread:
        await shard.check(0, 5, 0, quantize_message(torch.ones(10), "none")[0])
        await shard.step(0, 5, [(0, 1.0)], False)
        return threading.current_thread()

    loop_thread = asyncio.run(round_())
    assert set(ran) == {"decode", "step"}
    assert ran["decode"] is not loop_thread and ran["step"] is not loop_thread, ran
    assert ran["step"].name.startswith("outer-maths")  # the one FIFO maths thread: steps stay in order
