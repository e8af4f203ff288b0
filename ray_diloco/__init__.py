"""ray_diloco: DiLoCo training of language models on Ray (Streaming DiLoCo is being built on the
per-fragment exchange).

Python API::

    import ray_diloco
    summary = ray_diloco.train({"diloco": {"replicas": 2, "H": 50}}, overrides=["run.steps=200"])
"""

from ray_diloco.config import Config, load_config
from ray_diloco.errors import CheckpointError, ClusterError, ConfigError, DataError, RayDilocoError

__version__ = "0.1.0"


def train(*args, **kwargs):
    """Run DiLoCo or the DP baseline; see :func:`ray_diloco.runtime.launcher.train`."""
    from ray_diloco.runtime.launcher import train as _train

    return _train(*args, **kwargs)


__all__ = [
    "train",
    "Config",
    "load_config",
    "RayDilocoError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "ClusterError",
    "__version__",
]
