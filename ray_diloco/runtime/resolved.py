"""What a run fixes when it starts, beyond what its config says.

A user's config may leave open the number of inner steps (``run.tokens_per_parameter``: the
scaling-law protocol's token budget D = tokens_per_parameter x N, arXiv 2503.09799 section 3),
the model's shape (``model.preset`` fills every shape field left unset) and the CPUs per worker
(``diloco.cpus_per_worker: null`` shares the cluster's). A run resolves them once, into a
:class:`ResolvedRun`, and never writes them back into the user's config object: the run's own
config (what its workers, ``config.yaml`` and checkpoints see) is ``resolved.apply(config)``.
Recording the pinned shape keeps a run resumable whatever later versions make of a preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ray_diloco.config import Config, load_config
from ray_diloco.models.transformer import SHAPE_FIELDS, pin_model_fields


@dataclass(frozen=True)
class ResolvedRun:
    """The values a run resolved at start.

    Attributes:
        steps: inner steps of the run (``run.steps``, or the token budget's).
        model: the model's shape fields (``SHAPE_FIELDS``: family, layers, heads, width, FFN,
            context, z-loss), the preset's values where the config left them unset.
        cpus_per_worker: CPUs each worker actor takes; None until the cluster is known
            (``Trainer.start``) when the config leaves it unset.
    """

    steps: int
    model: dict[str, Any] = field(default_factory=dict)
    cpus_per_worker: float | None = None

    @classmethod
    def resolve(cls, cfg: Config, steps: int | None = None) -> ResolvedRun:
        """Pin ``cfg``'s model shape (on a copy) and take ``steps`` (default ``run.steps``)."""
        pinned = pin_model_fields(dataclasses.replace(cfg.model))
        return cls(
            cfg.run.steps if steps is None else int(steps),
            {f: getattr(pinned, f) for f in SHAPE_FIELDS},
            cfg.diloco.cpus_per_worker,
        )

    def with_cpus(self, cpus: float) -> ResolvedRun:
        """The same with the CPUs per worker the cluster gives."""
        return dataclasses.replace(self, cpus_per_worker=cpus)

    def apply(self, cfg: Config) -> Config:
        """A copy of ``cfg`` with the resolved values (``cfg`` itself is not changed)."""
        run = load_config(cfg, validate=False)
        run.run.steps = self.steps
        for name, value in self.model.items():
            setattr(run.model, name, value)
        run.diloco.cpus_per_worker = self.cpus_per_worker
        return run
