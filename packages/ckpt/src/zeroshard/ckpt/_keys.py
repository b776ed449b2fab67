"""The names of what a checkpoint's rank files hold: shard, buffer, whole-parameter state
and extra keys, and the files' own names."""

from __future__ import annotations

MASTER = "master"
PARAM = "param"
OPTIM_PREFIX = "optim."
BUFFER_PREFIX = "buffer."
PARAM_STATE_PREFIX = "pstate."
# A rank's own extra tensors (the caller's state beside the shards: see `RankExtra`).
EXTRA_PREFIX = "extra."
# The rank file's safetensors `__metadata__` entry holding the extra's JSON text.
EXTRA_METADATA = "zeroshard.extra"
CHECKSUM_ALGORITHM = "crc32"


def shard_key(group: str, kind: str) -> str:
    """The key of a group's shard of one kind in a rank file ('g0.master', 'g0.optim.exp_avg')."""
    return f"{group}.{kind}"


def buffer_key(name: str) -> str:
    """The key of a module buffer in rank 0's file."""
    return BUFFER_PREFIX + name


def param_state_key(param: str, state: str) -> str:
    """The key of one whole-parameter optimizer state tensor in its owner's rank file."""
    return f"{PARAM_STATE_PREFIX}{param}/{state}"


def extra_key(name: str) -> str:
    """The key of one of a rank's extra tensors in its own file."""
    return EXTRA_PREFIX + name


def rank_file(rank: int) -> str:
    """The file name of a rank's shards."""
    return f"rank{rank:05d}.safetensors"


RANK_FILE_GLOB = "rank*.safetensors"
