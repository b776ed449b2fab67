"""Where snapshots live: this node's folder in shared memory, and which rank keeps whose
replica.

[Note: a node's folder]
Snapshots are files in shared memory (`/dev/shm`), which outlives a worker process but
not its machine. The folder is named per job and per node:
`{root}/zeroshard-{run id}/{host}-{agent pid}`. The run id is torchrun's rendezvous id
(`TORCHELASTIC_RUN_ID`); the node is the torchrun agent, whose workers' parent it is: a
worker torchrun restarts has the same parent and finds the folder, while a node that
replaces a lost one is a new agent and starts empty, as a new machine would, also when
two agents stand for two nodes on one machine. Outside torchrun the process itself is
the node.

[Note: the replica's rank]
Every rank sends its snapshot to one rank of the next node (nodes ordered by their
first rank, the last node's next being the first), the one at its own place among that
node's ranks (modulo their number), so that losing a node loses no rank's snapshot
whose replica lives elsewhere. With one node the next node is the node itself: the
replica goes to the next local rank, which survives a worker's crash (and shared memory
keeps the rank's own copy anyway). One rank alone keeps no replica.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RUN_ID = "TORCHELASTIC_RUN_ID"


def job_folder(root: Path) -> Path:
    """This job's folder under `root` (see [Note: a node's folder])."""
    return root / f"zeroshard-{os.environ.get(RUN_ID, 'none')}"


def node_key() -> str:
    """This node's name within the job: host and torchrun agent (see [Note: a node's folder])."""
    agent = os.getppid() if RUN_ID in os.environ else os.getpid()
    return f"{socket.gethostname()}-{agent}"


@dataclass(frozen=True)
class Placement:
    """Every rank's node and replica holder, the same on every rank.

    `nodes[r]` is rank r's node key; `buddy[r]` the rank keeping rank r's replica (None
    for a world of one). See [Note: the replica's rank]."""

    nodes: tuple[str, ...]
    buddy: tuple[int | None, ...]

    @staticmethod
    def of(nodes: Sequence[str]) -> Placement:
        """The placement of ranks on `nodes` (rank -> node key)."""
        order: list[str] = []
        members: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            if node not in members:
                order.append(node)
                members[node] = []
            members[node].append(rank)
        buddy: list[int | None] = []
        for rank, node in enumerate(nodes):
            here = members[node]
            place = here.index(rank)
            if len(order) == 1:  # one node: the next local rank (none when alone)
                buddy.append(here[(place + 1) % len(here)] if len(here) > 1 else None)
                continue
            nxt = members[order[(order.index(node) + 1) % len(order)]]
            buddy.append(nxt[place % len(nxt)])
        return Placement(tuple(nodes), tuple(buddy))

    def wards(self, rank: int) -> list[int]:
        """The ranks whose replica `rank` keeps."""
        return [r for r, b in enumerate(self.buddy) if b == rank]

    def node_ranks(self, node: str) -> list[int]:
        """The ranks on `node`."""
        return [r for r, n in enumerate(self.nodes) if n == node]

    @property
    def spread(self) -> bool:
        """Whether every replica lives on another node than its rank."""
        return all(b is None or self.nodes[b] != self.nodes[r] for r, b in enumerate(self.buddy))
