"""The driver's files: the outer side's part of a checkpoint (``outer.pt``) and the exported
model's weights, written and read from the driver's own process (the job's never holds the global
parameters)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import ray
import torch


class DriverFiles:
    """The driver's checkpoint and export files, written and read from its own process (the job's
    never holds the global parameters).

    Args (the driver's calls that give and take the state, coroutines of its event loop):
        state_dict: the whole outer state (``OuterDriver.state_dict``).
        read_unit: ``(unit, start, stop)`` -> fp32 values of an exchange unit (``OuterDriver.read_unit``).
        init_global, load_state_dict: set the global parameters, then the rest of a state.
    """

    def __init__(self, state_dict: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
                 read_unit: Callable[[int, int, int], Coroutine[Any, Any, np.ndarray]],
                 init_global: Callable[[list[Any]], Awaitable[None]],
                 load_state_dict: Callable[[dict[str, Any]], Awaitable[None]]):  # fmt: skip
        self.state_dict, self.read_unit = state_dict, read_unit
        self.init_global, self.load_state_dict = init_global, load_state_dict

    async def save_state(self, path: str, token: str | None, upload: str | None) -> dict[str, Any]:
        """See :meth:`OuterDriver.save_state`."""
        from pathlib import Path

        from ray_diloco.components.checkpoint import write_own_file

        node, loop = ray.get_runtime_context().get_node_id(), asyncio.get_running_loop()

        def state() -> dict[str, Any]:  # on the writing thread: the state is gathered on the event loop
            return asyncio.run_coroutine_threadsafe(self.state_dict(), loop).result()

        return await asyncio.to_thread(write_own_file, Path(path), token, state, upload, node)

    async def export_weights(
        self, out_dir: str, fragments: list[Any], units: int, dtype: torch.dtype, token: str
    ) -> dict[str, int] | None:
        """See :meth:`OuterDriver.export_weights`."""
        from pathlib import Path

        from ray_diloco.components.checkpoint import sees_marker
        from ray_diloco.components.export import write_hf_weights
        from ray_diloco.core.shards import read_fragment_range

        if not sees_marker(out_dir, token):
            return None
        loop = asyncio.get_running_loop()

        def read(i: int, start: int, stop: int) -> np.ndarray:  # on the writer's thread
            def part(rank: int, a: int, b: int) -> np.ndarray:
                return asyncio.run_coroutine_threadsafe(self.read_unit(i * units + rank, a, b), loop).result()

            return read_fragment_range(fragments[i], units, part, start, stop)

        names = await asyncio.to_thread(write_hf_weights, fragments, read, Path(out_dir), dtype)
        return {n: (Path(out_dir) / n).stat().st_size for n in names}

    async def load_state_file(self, entry: dict[str, Any], checkpoint_id: str | None) -> bool:
        """See :meth:`OuterDriver.load_state_file`."""
        from ray_diloco.components.checkpoint import read_own_state

        state = await asyncio.to_thread(read_own_state, entry, checkpoint_id)
        if state is None:
            return False
        await self.init_global(state["global"])
        await self.load_state_dict(state)
        return True
