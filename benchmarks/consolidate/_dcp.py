"""PyTorch DCP checkpoints: FSDP2's ranks write one, torch's `dcp_to_torch_save` is the peer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.consolidate._model import GPT
from benchmarks.consolidate._source import Checkpoint, Command, Source

# dcp_to_torch_save writes one pickle file; it is given a directory like the other tools.
_TO_TORCH = (
    "import os, sys; from torch.distributed.checkpoint.format_utils import "
    "dcp_to_torch_save as f; os.makedirs(sys.argv[2]); "
    "f(sys.argv[1], os.path.join(sys.argv[2], 'model.bin'))"
)


def make_rank(rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
    """FSDP2 makes the checkpoint: the GPT in fp32, `fully_shard` per block and at the
    root on this rank's device, `dcp.save(model.state_dict())`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.layers, tied=not args.untied)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # moves the shards to the mesh's device
    dcp.save(model.state_dict(), checkpoint_id=str(out))  # type: ignore[attr-defined]


def read(ckpt: Path) -> Checkpoint:
    """The model tensors zeroshard reads from the checkpoint, one rank file per rank."""
    from zeroshard.ckpt.foreign._dcp import dcp_specs

    shards = sorted(ckpt.glob("*.distcp"))
    return Checkpoint(dcp_specs(ckpt), len(shards), shards)


DCP = Source(
    name="dcp",
    section="consolidate_dcp",
    title="Consolidating an FSDP2 DCP checkpoint",
    kind="DCP checkpoint",
    made_by="FSDP2",
    shard_files="rank files",
    peer="dcp_to_torch_save",
    make_rank=make_rank,
    read=read,
    peer_commands=(
        Command(
            "dcp_to_torch_save", lambda c, o: [sys.executable, "-c", _TO_TORCH, str(c), str(o)]
        ),
    ),
)
