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
half the restarts, at random. Prefixing the store with the attempt number
(`TORCHELASTIC_RESTART_COUNT`) gives every attempt keys of its own.

On one node every worker of an attempt has the same restart count. Several agents
(multi-node) count alike when the whole job restarts on a failure; an agent that
restarts only because another node joined or left does not count that restart (torch's
`--max-restarts` accounting), so after such a membership change the counts differ and
the ranks would wait for each other in different namespaces: the group's timeout then
ends it with an error rather than a wrong result.
"""

from __future__ import annotations

import datetime
import os

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

    Under torchrun the store is prefixed with the attempt (`TORCHELASTIC_RUN_ID`,
    `TORCHELASTIC_RESTART_COUNT`): see [Note: stale store keys after a restart].
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
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    prefixed = PrefixStore(f"zeroshard/{run_id}/attempt{attempt}", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout
    )
