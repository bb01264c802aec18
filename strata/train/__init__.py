"""The training runtime: data, optimiser, mixed precision, activation checkpointing, DDP/FSDP,
checkpoints and metrics, on the same model modules the engine serves.

    from strata.train import TrainConfig, Trainer
    result = Trainer(TrainConfig(data=["corpus/"], max_steps=200)).fit()

Names resolve lazily, so importing strata.train.config (as `strata plan --train` and the hf run of
`strata bench train` do) does not import the trainer and torch's training stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata.train.config import TrainConfig
    from strata.train.trainer import Trainer, TrainResult

__all__ = ["TrainConfig", "Trainer", "TrainResult"]


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":
        from strata.train.config import TrainConfig  # PEP 562: resolved on first use (docstring)

        return TrainConfig
    if name in ("Trainer", "TrainResult"):
        from strata.train import trainer  # PEP 562: resolved on first use (docstring)

        return getattr(trainer, name)
    raise AttributeError(f"module 'strata.train' has no attribute {name!r}")
