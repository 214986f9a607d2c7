"""`RunSpec`: a config parsed once into the typed pieces the tools build from."""

from __future__ import annotations

import dataclasses

import ml_collections

import sharding
from lm.config import UserError, checked
from lm.model.config import ModelConfig
from lm.model.precision import Policy
from lm.program.loss_scale import LossScaling
from sharding.schedules import PipelinePlan, least_microbatches


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A config parsed once into the typed pieces the tools build from. The `train`, `optim`,
    `data` and `checkpoint` groups are plain values, read from `config` where they are used."""

    config: ml_collections.ConfigDict
    model: ModelConfig
    policy: Policy
    pipeline: PipelinePlan
    loss_scaling: LossScaling
    mesh: sharding.MeshConfig
    rules: tuple

    @classmethod
    def parse(cls, c: ml_collections.ConfigDict, vocab_size: int, *, observe: bool = False) -> RunSpec:
        """`observe`: every block matmul also reports its statistics (`lm.numerics`)."""
        c = checked(c)
        if c.model.vocab_size and vocab_size > c.model.vocab_size:
            raise UserError(
                f"the tokenizer has {vocab_size} ids but model.vocab_size={c.model.vocab_size}; "
                "raise model.vocab_size (0: the tokenizer's) or use the model's own tokenizer"
            )
        policy = Policy.from_config(c.precision)
        stages = c.mesh.stage
        pipe = c.pipeline
        plan = PipelinePlan(stages, pipe.microbatches or least_microbatches(pipe.schedule, stages), pipe.repeats, pipe.remat, pipe.schedule) if stages > 1 else PipelinePlan()
        return cls(
            config=c,
            model=ModelConfig.from_config(c, vocab_size),
            policy=dataclasses.replace(policy, observe=True) if observe else policy,
            pipeline=plan,
            loss_scaling=LossScaling.from_config(c.precision),
            mesh=sharding.MeshConfig.from_mapping(c.mesh),
            rules=rules_from(c),
        )


def rules_from(c: ml_collections.ConfigDict) -> tuple:
    """The default rules, overridden by `sharding.rules`, then sequence parallelism if asked for."""
    overrides = [c.sharding.rules or ()]
    if c.sharding.sequence_parallel:
        overrides.append(sharding.SEQUENCE_PARALLEL_RULES)
    return sharding.merge_rules(sharding.DEFAULT_RULES, *overrides)
