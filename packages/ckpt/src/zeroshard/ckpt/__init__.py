"""zeroshard.ckpt: atomic sharded checkpoints, resharding, and streamed safetensors export.

`save` (on every rank) writes each rank's flat shards and commits the checkpoint
atomically; `load` returns one rank's shards for any world size; `consolidate` (and
the `zeroshard-ckpt` command) writes the full state dict as safetensors, from a
zeroshard checkpoint, a DeepSpeed ZeRO checkpoint (`read_deepspeed_checkpoint` reads
DeepSpeed's files without DeepSpeed, refusing unsafe pickles) or a PyTorch DCP
directory. The on-disk format is described in docs/checkpoint-format.md.
"""

from zeroshard.ckpt._consolidate import consolidate
from zeroshard.ckpt._deepspeed import (
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    MissingRankFileError,
    read_deepspeed_checkpoint,
)
from zeroshard.ckpt._errors import (
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
from zeroshard.ckpt._inspect import Summary, describe
from zeroshard.ckpt._load import GroupPlacement, LoadedShards, load
from zeroshard.ckpt._meta import CheckpointMeta, GroupMeta, buffer_key, shard_key
from zeroshard.ckpt._paths import list_checkpoints, read_latest, remove_checkpoint
from zeroshard.ckpt._save import SaveHandle, save
from zeroshard.ckpt._unpickle import CorruptFileError, UnsafePickleError
from zeroshard.ckpt._writer import WriteResult

__all__ = [
    "CheckpointError",
    "CheckpointMeta",
    "ChecksumError",
    "CorruptFileError",
    "DeepSpeedCheckpoint",
    "DeepSpeedCheckpointError",
    "FormatVersionError",
    "GroupMeta",
    "GroupPlacement",
    "LoadedShards",
    "MissingRankFileError",
    "MissingShardError",
    "ModelMismatchError",
    "OutputExistsError",
    "SaveHandle",
    "Summary",
    "UnsafePickleError",
    "WriteResult",
    "buffer_key",
    "consolidate",
    "describe",
    "list_checkpoints",
    "load",
    "read_deepspeed_checkpoint",
    "read_latest",
    "remove_checkpoint",
    "save",
    "shard_key",
]
