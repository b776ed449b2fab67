"""`ZeroTrainer`: `transformers.Trainer` on zeroshard (needs the `hf` extra: transformers).

    from zeroshard.engine.huggingface import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=training_args, zero_config={"stage": 3}, ...)

An integration: it imports every other part of the engine, never the engine's public
face; docs/huggingface.md is the guide.
"""

from zeroshard.engine.huggingface._trainer import (
    CHECKPOINT_SUBDIR,
    ZeroTrainer,
    rebuild_meta_buffers,
)

__all__ = ["CHECKPOINT_SUBDIR", "ZeroTrainer", "rebuild_meta_buffers"]
