"""`init_process_group`: the default process group from the launcher's environment,
one that comes up after every `torchrun` restart.

[Note: stale store keys after a restart]
With its c10d rendezvous, `torchrun` hosts one TCPStore in the agent and shares it with
the workers of every attempt (`TORCHELASTIC_USE_AGENT_STORE=True`, the same
`MASTER_ADDR:MASTER_PORT` each time). torch's `env://` rendezvous connects the restarted
workers to that store without a per-attempt prefix, and gloo (like NCCL) exchanges
its addresses under fixed keys (`default_pg/0/...`). The keys of the attempt that died
are still there, so a restarted rank may read a dead peer's address and fail in
`connectFullMesh` ("Connection refused") or hang, depending on who wrote first: about
half the restarts, at random. Every attempt needs keys of its own.

The attempt number (`TORCHELASTIC_RESTART_COUNT`) is not such a key with several agents
(multi-node): the agents
count alike when the whole job restarts on a failure, but an agent restarted because
another node joined or left does not count that restart (torch's `--max-restarts`
accounting), so after a membership change a surviving node and a joining one start
their workers with different `TORCHELASTIC_RESTART_COUNT`s, and a later round may have
the same count as an earlier one. Within one rendezvous round only the environment's
`TORCHELASTIC_RUN_ID`, `WORLD_SIZE` and the store's address agree, and they repeat
across rounds. So the ranks agree on a key of their own in the store: rank 0 (one
process per round) posts a fresh random round key, and every other rank takes a key
only once rank 0 has acknowledged it under that key (see `_agree_round`); a rank that
read the key of a round that ended is never acknowledged under it and reads again.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

# Public at runtime (torch.distributed re-exports them) though its stubs do not say so.
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_process_group(
    backend: str | None = None, *, timeout: datetime.timedelta | None = None
) -> None:
    """`torch.distributed.init_process_group` from the environment a launcher sets
    (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`: torchrun, or SLURM's `srun`
    with them exported), safe across `torchrun --max-restarts` restarts.

    Under torchrun the store is prefixed with a key all ranks of the rendezvous round
    agree on: see [Note: stale store keys after a restart].
    `backend` None lets torch choose (gloo for CPU, NCCL for CUDA tensors); `timeout` is
    the group's collective timeout (torch's default if None).
    """
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized")
    missing = [n for n in _NEEDED if n not in os.environ]
    if missing:
        raise ValueError(
            f"environment variable(s) {missing} not set: launch with torchrun (or export "
            "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, e.g. from SLURM_PROCID, "
            "SLURM_NTASKS and the first host of SLURM_JOB_NODELIST under srun)"
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    # The agent hosts the store when it shares its own (torchrun's default); otherwise
    # rank 0 hosts one per attempt, as torch's env:// rendezvous does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT"),
        world_size,
        is_master=not agent_store and rank == 0,
        timeout=timeout or datetime.timedelta(minutes=10),
        multi_tenant=True,
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    base = f"zeroshard/{run_id}"
    deadline = time.monotonic() + (timeout or datetime.timedelta(minutes=10)).total_seconds()
    prefixed = PrefixStore(_agree_round(store, base, rank, world_size, deadline), store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )


_POLL_S = 0.05  # how often a rank looks for a key it waits on


def _poll(store: TCPStore, key: str, deadline: float, what: str) -> None:
    """Wait until `key` is set; past `deadline`, raise naming `what` was awaited."""
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"init_process_group: timed out waiting for {what}")
        time.sleep(_POLL_S)


def _agree_round(store: TCPStore, base: str, rank: int, world_size: int, deadline: float) -> str:
    """The store prefix of this rendezvous round, the same on every rank of it and on no
    earlier round's ranks: see [Note: stale store keys after a restart]."""
    me = uuid.uuid4().hex  # this process: no earlier round's rank has it
    if rank == 0:
        # Set before anyone can be acknowledged under it, so a rank that reads the key
        # and sees its acknowledgement knows rank 0 of this round wrote both.
        store.set(f"{base}/round", me)
        for r in range(1, world_size):
            _poll(store, f"{base}/{me}/hello/{r}", deadline, f"rank {r} to join round {me}")
            store.set(f"{base}/{me}/ack/{r}", store.get(f"{base}/{me}/hello/{r}").decode())
        return f"{base}/{me}"
    while True:
        _poll(store, f"{base}/round", deadline, "rank 0 to post the round's key")
        key = store.get(f"{base}/round").decode()
        store.set(f"{base}/{key}/hello/{rank}", me)
        # A key of a round that ended: its rank 0 is gone and never acknowledges `me`
        # (or acknowledged the rank before us). Look again after a short wait.
        patience = min(deadline, time.monotonic() + 1.0)
        ack = f"{base}/{key}/ack/{rank}"
        while not store.check([ack]) and time.monotonic() < patience:
            time.sleep(_POLL_S)
        if store.check([ack]) and store.get(ack).decode() == me:
            return f"{base}/{key}"
        if time.monotonic() > deadline:
            raise TimeoutError("init_process_group: timed out waiting for rank 0's round key")
