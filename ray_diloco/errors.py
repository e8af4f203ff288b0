"""Errors that the CLI turns into one clear line each and a non-zero exit (no traceback)."""

from __future__ import annotations


class RayDilocoError(Exception):
    """Base class: a user-facing problem with input, data, checkpoints or the cluster."""

    def lines(self) -> list[str]:
        """The message as the lines the CLI prints (one per problem)."""
        return [str(self)]


class ConfigError(RayDilocoError):
    """One or more invalid config fields; ``problems`` holds one line per field."""

    def __init__(self, problems: list[str] | str):
        # a str: the error rebuilt from its message (Ray re-raises a remote error that way)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))

    def lines(self) -> list[str]:
        """One ``config error: FIELD = VALUE: what is allowed`` line per problem."""
        return [f"config error: {p}" for p in self.problems]


class UsageError(RayDilocoError):
    """Invalid command-line options; ``problems`` holds one line per option."""

    def __init__(self, problems: list[str] | str):
        # a str: the error rebuilt from its message (Ray re-raises a remote error that way)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))

    def lines(self) -> list[str]:
        return list(self.problems)


class DataError(RayDilocoError):
    """The corpus or tokenizer cannot be loaded or is too small for the run."""


class CheckpointError(RayDilocoError):
    """A checkpoint or run directory is missing, corrupt or incompatible."""


class ClusterError(RayDilocoError):
    """The Ray cluster cannot host the requested replicas, or a replica failed."""


class RunStopped(ClusterError):
    """A run stopped part-way because its outer-optimiser side failed; the launcher adds how to go
    on (resume from the last checkpoint, or start again when none was written)."""
