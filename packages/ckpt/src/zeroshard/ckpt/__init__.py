"""zeroshard.ckpt: atomic sharded checkpoints, resharding, and streamed safetensors export.

`save` (on every rank) writes each rank's flat shards and commits the checkpoint
atomically; `load` returns one rank's shards for any world size; `consolidate` (and
the `zeroshard-ckpt` command) writes the full state dict as safetensors, from a
zeroshard or a DeepSpeed ZeRO checkpoint (`read_deepspeed_checkpoint` and
`deepspeed_specs` read DeepSpeed's files without DeepSpeed, refusing unsafe pickles).
The on-disk format is described in docs/checkpoint-format.md.
"""

from zeroshard.ckpt._agree import agreed
from zeroshard.ckpt._consolidate import consolidate, is_zeroshard_checkpoint
from zeroshard.ckpt._deepspeed import (
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    MissingRankFileError,
    deepspeed_specs,
    is_deepspeed_checkpoint,
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
from zeroshard.ckpt._inspect import Summary, describe, format_summary
from zeroshard.ckpt._load import GroupPlacement, LoadedShards, load
from zeroshard.ckpt._meta import (
    FORMAT_VERSION,
    MASTER,
    PARAM,
    CheckpointMeta,
    FileMeta,
    GroupMeta,
    buffer_key,
    rank_file,
    shard_key,
)
from zeroshard.ckpt._paths import (
    LATEST,
    METADATA,
    list_checkpoints,
    read_latest,
    remove_checkpoint,
    resolve,
)
from zeroshard.ckpt._plan import parse_size
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt._save import SaveHandle, save
from zeroshard.ckpt._source import checkpoint_specs
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._unpickle import CorruptFileError, UnsafePickleError
from zeroshard.ckpt._writer import RangeSpec, WriteResult, write_safetensors

__all__ = [
    "FORMAT_VERSION",
    "LATEST",
    "MASTER",
    "METADATA",
    "PARAM",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointReader",
    "ChecksumError",
    "CorruptFileError",
    "DeepSpeedCheckpoint",
    "DeepSpeedCheckpointError",
    "FileMeta",
    "FormatVersionError",
    "GroupMeta",
    "GroupPlacement",
    "LoadedShards",
    "MissingRankFileError",
    "MissingShardError",
    "ModelMismatchError",
    "OutputExistsError",
    "RangeSpec",
    "SaveHandle",
    "Summary",
    "TensorSpec",
    "UnsafePickleError",
    "WriteResult",
    "agreed",
    "buffer_key",
    "checkpoint_specs",
    "consolidate",
    "deepspeed_specs",
    "describe",
    "format_summary",
    "is_deepspeed_checkpoint",
    "is_zeroshard_checkpoint",
    "list_checkpoints",
    "load",
    "parse_size",
    "rank_file",
    "read_deepspeed_checkpoint",
    "read_latest",
    "remove_checkpoint",
    "resolve",
    "save",
    "shard_key",
    "write_safetensors",
]
