"""PyTorch DCP checkpoints: FSDP2's ranks write one, torch's `dcp_to_torch_save` is the peer."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.consolidate._model import GPT
from benchmarks.consolidate._source import Checkpoint, Command

# dcp_to_torch_save writes one pickle file; it is given a directory like the other tools.
_TO_TORCH = (
    "import os, sys; from torch.distributed.checkpoint.format_utils import "
    "dcp_to_torch_save as f; os.makedirs(sys.argv[2]); "
    "f(sys.argv[1], os.path.join(sys.argv[2], 'model.bin'))"
)


@dataclass(frozen=True)
class DcpSource:
    """FSDP2 makes the checkpoint: the GPT in fp32, `fully_shard` per block and at the
    root, `dcp.save(model.state_dict())`. The peer: torch's `dcp_to_torch_save`."""

    name: str = "dcp"
    section: str = "consolidate_dcp"
    title: str = "Consolidating an FSDP2 DCP checkpoint"
    kind: str = "DCP checkpoint"
    made_by: str = "FSDP2"
    shard_files: str = "rank files"
    peer: str = "dcp_to_torch_save"
    has_goals: bool = False

    def make_rank(self, rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
        """`fully_shard` the GPT on this rank's device, then `dcp.save` its state dict."""
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

    def read(self, ckpt: Path) -> Checkpoint:
        """The model tensors zeroshard reads from the checkpoint."""
        from zeroshard.ckpt._dcp import dcp_specs

        specs = dcp_specs(ckpt)
        shards = sorted(ckpt.glob("*.distcp"))
        return Checkpoint(
            numels=[s.numel for s in specs],
            dtypes=[s.dtype for s in specs],
            world=len(shards),
            shard_files=shards,
        )

    def peer_commands(self) -> list[Command]:
        """`dcp_to_torch_save` into `out/model.bin`."""
        return [
            Command(
                "dcp_to_torch_save", lambda c, o: [sys.executable, "-c", _TO_TORCH, str(c), str(o)]
            )
        ]
