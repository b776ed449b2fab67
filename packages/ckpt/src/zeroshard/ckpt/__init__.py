"""zeroshard.ckpt: atomic sharded checkpoints, resharding, and streamed safetensors export.

`save` (on every rank) writes each rank's flat shards and commits the checkpoint
atomically; `load` returns one rank's shards for any world size; `consolidate` (and
the `zeroshard-ckpt` command) writes the full state dict as safetensors, from a
zeroshard checkpoint, a DeepSpeed ZeRO checkpoint (`read_deepspeed_checkpoint` reads
DeepSpeed's files without DeepSpeed, refusing unsafe pickles) or a PyTorch DCP
directory; `read_deepspeed_training_state` reads a DeepSpeed run's optimizer state and
loss scale by parameter name, to resume it, and `convert_deepspeed` rewrites it as a
zeroshard checkpoint (read back by name with `read_named_state`);
`read_dcp_training_state` reads an FSDP2 or torchtitan DCP checkpoint's weights,
optimizer state and step the same way, and `convert_to_dcp` writes a zeroshard
checkpoint as one an FSDP2 job loads. `resume_order` lists
the checkpoints of a root a restart should try, best first. `read_safetensors_header`
and `pread_into` read any safetensors file by byte range. The on-disk format is
described in docs/checkpoint-format.md.
"""

from zeroshard.ckpt._consolidate import consolidate
from zeroshard.ckpt._errors import (
    CHECKPOINT_ERRORS,
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
from zeroshard.ckpt._extra import RankExtra
from zeroshard.ckpt._group_meta import GroupMeta, ParamState, TensorSplit
from zeroshard.ckpt._inspect import Summary, describe
from zeroshard.ckpt._keys import MASTER, OPTIM_PREFIX, buffer_key, param_state_key, shard_key
from zeroshard.ckpt._load import GroupPlacement, LoadedShards, load
from zeroshard.ckpt._meta import CheckpointMeta, check_names_shapes
from zeroshard.ckpt._names import canonical_name
from zeroshard.ckpt._paths import checkpoint_step, list_checkpoints, read_latest, remove_checkpoint
from zeroshard.ckpt._resume_order import ResumeOrder, resume_order
from zeroshard.ckpt._save import SaveHandle, save
from zeroshard.ckpt._stfile import pread_into
from zeroshard.ckpt._stfile import read_header as read_safetensors_header
from zeroshard.ckpt._stfile import st_code as safetensors_dtype_code
from zeroshard.ckpt._stfile import st_dtype as safetensors_dtype
from zeroshard.ckpt._writer import RangeSpec, WriteResult
from zeroshard.ckpt.foreign import (
    CorruptFileError,
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    LossScaleState,
    MissingRankFileError,
    NamedParamGroup,
    NamedTrainingState,
    UnsafePickleError,
    convert_deepspeed,
    convert_to_dcp,
    is_converted_checkpoint,
    is_dcp_checkpoint,
    is_deepspeed_checkpoint,
    read_dcp_training_state,
    read_deepspeed_checkpoint,
    read_deepspeed_training_state,
    read_named_state,
)

__all__ = [
    "CHECKPOINT_ERRORS",
    "MASTER",
    "OPTIM_PREFIX",
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
    "ParamState",
    "RangeSpec",
    "RankExtra",
    "ResumeOrder",
    "SaveHandle",
    "Summary",
    "TensorSplit",
    "UnsafePickleError",
    "WriteResult",
    "buffer_key",
    "canonical_name",
    "check_names_shapes",
    "checkpoint_step",
    "consolidate",
    "convert_deepspeed",
    "convert_to_dcp",
    "describe",
    "is_converted_checkpoint",
    "is_dcp_checkpoint",
    "is_deepspeed_checkpoint",
    "list_checkpoints",
    "load",
    "param_state_key",
    "pread_into",
    "read_dcp_training_state",
    "read_deepspeed_checkpoint",
    "read_deepspeed_training_state",
    "read_latest",
    "read_named_state",
    "read_safetensors_header",
    "remove_checkpoint",
    "resume_order",
    "safetensors_dtype",
    "safetensors_dtype_code",
    "save",
    "shard_key",
]
