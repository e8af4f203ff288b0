"""The outer-optimiser driver (``actor``: the Ray actor and its calls), cut along what it does:
the sync rounds (``rounds``), surviving a shard's loss (``recovery``), its checkpoint and export
files (``files``), and what they share (``common``)."""

from ray_diloco.runtime.driver.actor import OuterDriver, OuterDriverActor

__all__ = ["OuterDriver", "OuterDriverActor"]
