"""The errors a checkpoint can raise: each names the file, key or version at fault.

All derive from `CheckpointError`, itself a `ValueError`, so callers that only want
"bad checkpoint input" can catch one class.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (or a consolidation's output) cannot be used as asked."""


class FormatVersionError(CheckpointError):
    """`metadata.json` comes from a format version this build does not read."""


class ChecksumError(CheckpointError):
    """A file's size or checksum differs from the one recorded in `metadata.json`."""


class MissingShardError(CheckpointError):
    """A rank file (or `metadata.json`) that the checkpoint needs is not there."""


class ModelMismatchError(CheckpointError):
    """The checkpoint holds another model: names or shapes differ from the expected ones."""


class OutputExistsError(CheckpointError):
    """The output path (or checkpoint directory) exists and overwriting was not asked for."""


# The classes an agreement carries to every rank as themselves (zeroshard.comm's
# `Agreement.outcome`); an error of any other class arrives as a CheckpointError.
CHECKPOINT_ERRORS: tuple[type[CheckpointError], ...] = (
    CheckpointError,
    FormatVersionError,
    ChecksumError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
)
