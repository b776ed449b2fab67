"""Checkpoints of other formats: DeepSpeed ZeRO, PyTorch DCP, and zeroshard checkpoints
converted from them, read (and converted) without the library that wrote them.

The rest of ckpt reaches this folder through the names below; `zeroshard.ckpt`
re-exports the public ones. Modules here import ckpt's own internals (the writer's
specs, the on-disk format), never the other way but through this face.
"""

from zeroshard.ckpt.foreign._convert import convert_deepspeed as convert_deepspeed
from zeroshard.ckpt.foreign._dcp import DCP_METADATA as DCP_METADATA
from zeroshard.ckpt.foreign._dcp import dcp_specs as dcp_specs
from zeroshard.ckpt.foreign._dcp import has_dcp_metadata as has_dcp_metadata
from zeroshard.ckpt.foreign._dcp_state import is_dcp_checkpoint as is_dcp_checkpoint
from zeroshard.ckpt.foreign._dcp_state import read_dcp_training_state as read_dcp_training_state
from zeroshard.ckpt.foreign._dcp_write import DCP_LAYOUTS as DCP_LAYOUTS
from zeroshard.ckpt.foreign._dcp_write import convert_to_dcp as convert_to_dcp
from zeroshard.ckpt.foreign._deepspeed import DeepSpeedCheckpoint as DeepSpeedCheckpoint
from zeroshard.ckpt.foreign._deepspeed import DeepSpeedCheckpointError as DeepSpeedCheckpointError
from zeroshard.ckpt.foreign._deepspeed import MissingRankFileError as MissingRankFileError
from zeroshard.ckpt.foreign._deepspeed import read_deepspeed_checkpoint as read_deepspeed_checkpoint
from zeroshard.ckpt.foreign._deepspeed_files import (
    is_deepspeed_checkpoint as is_deepspeed_checkpoint,
)
from zeroshard.ckpt.foreign._deepspeed_optim import (
    read_deepspeed_training_state as read_deepspeed_training_state,
)
from zeroshard.ckpt.foreign._named_reader import (
    is_converted_checkpoint as is_converted_checkpoint,
)
from zeroshard.ckpt.foreign._named_reader import read_named_state as read_named_state
from zeroshard.ckpt.foreign._named_state import LossScaleState as LossScaleState
from zeroshard.ckpt.foreign._named_state import NamedParamGroup as NamedParamGroup
from zeroshard.ckpt.foreign._named_state import NamedTrainingState as NamedTrainingState
from zeroshard.ckpt.foreign._unpickle import CorruptFileError as CorruptFileError
from zeroshard.ckpt.foreign._unpickle import UnsafePickleError as UnsafePickleError
