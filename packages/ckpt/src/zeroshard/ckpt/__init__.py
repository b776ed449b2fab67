"""zeroshard.ckpt: atomic sharded checkpoints, resharding, and streamed safetensors export.

`save` (on every rank) writes each rank's flat shards and commits the checkpoint
atomically; `load` returns one rank's shards for any world size; `consolidate` (and
the `zeroshard-ckpt` command) writes the full state dict as safetensors, from a
zeroshard checkpoint, a DeepSpeed ZeRO checkpoint (`read_deepspeed_checkpoint` reads
DeepSpeed's files without DeepSpeed, refusing unsafe pickles) or a PyTorch DCP
directory; `read_deepspeed_training_state` reads a DeepSpeed run's optimizer state and
loss scale by parameter name, to resume it, and `convert_deepspeed` rewrites it as a
zeroshard checkpoint (read back by name with `read_named_state`). The on-disk format is described in
docs/checkpoint-format.md.
"""

from zeroshard.ckpt._consolidate import consolidate
from zeroshard.ckpt._convert import convert_deepspeed
from zeroshard.ckpt._deepspeed import (
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    MissingRankFileError,
    read_deepspeed_checkpoint,
)
from zeroshard.ckpt._deepspeed_files import is_deepspeed_checkpoint
from zeroshard.ckpt._deepspeed_optim import read_deepspeed_training_state
from zeroshard.ckpt._errors import (
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
from zeroshard.ckpt._extra import RankExtra
from zeroshard.ckpt._inspect import Summary, describe
from zeroshard.ckpt._load import GroupPlacement, LoadedShards, load
from zeroshard.ckpt._meta import CheckpointMeta, GroupMeta, buffer_key, shard_key
from zeroshard.ckpt._named_reader import is_converted_checkpoint, read_named_state
from zeroshard.ckpt._named_state import LossScaleState, NamedParamGroup, NamedTrainingState
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
    "LossScaleState",
    "MissingRankFileError",
    "MissingShardError",
    "ModelMismatchError",
    "NamedParamGroup",
    "NamedTrainingState",
    "OutputExistsError",
    "RankExtra",
    "SaveHandle",
    "Summary",
    "UnsafePickleError",
    "WriteResult",
    "buffer_key",
    "consolidate",
    "convert_deepspeed",
    "describe",
    "is_converted_checkpoint",
    "is_deepspeed_checkpoint",
    "list_checkpoints",
    "load",
    "read_deepspeed_checkpoint",
    "read_deepspeed_training_state",
    "read_latest",
    "read_named_state",
    "remove_checkpoint",
    "save",
    "shard_key",
]
