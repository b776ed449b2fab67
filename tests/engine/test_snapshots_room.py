"""Room in shared memory for snapshots ([Note: room in shared memory] in
zeroshard/engine/recovery/_room.py): `Snapshots(...)` refuses, on every rank with one
ValueError, a node whose free space cannot hold its full snapshots' slots and replicas
beside the journal, at construction (a full snapshot's masters) and at the first take
(its exact size, the optimizer's state in it), before a slot is made; a slot or replica
for which tmpfs has no room is a named RuntimeError, not a SIGBUS.

Three ways to meet a full tmpfs for real, no `os.statvfs` mocked:
- on the test folder's own filesystem (any machine): `full_every` makes the journal take
  all but a few snapshots' worth of the free space `os.statvfs` reads, and the full
  snapshots tip it over (the journal alone fits: the check that counted only the journal
  let it through, and the take made its slots);
- a real `posix_fallocate` larger than the whole tmpfs of /dev/shm, which tmpfs refuses
  at once with ENOSPC, reserving nothing;
- a tmpfs of Docker's default 64 MiB, mounted in a user and mount namespace of the
  test's own (`unshare -Urm`, where the machine allows it): refused at the first take,
  then filled after the check so that a replica finds no room."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_ranks
from zeroshard.engine.recovery import Snapshots
from zeroshard.engine.recovery._replicas import Replicas
from zeroshard.engine.recovery._slots import Slots
from zeroshard.engine.recovery._store import NodeStore
from zeroshard.engine.runtime._state import engine_module, engine_state

WIDTH = 2048  # two 2048 x 2048 matrices: 16 MiB of fp32 masters per rank of 2 at stage 2


def _engine() -> tuple[nn.Module, zs.ZeroOptimizer]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    return zs.initialize(plain, opt, {"stage": 2})


def _everyone(value: int) -> list[int]:
    out: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _free(folder: str) -> int:
    """Rank 0's reading of the free bytes, on every rank (each node reads its own, and
    every rank must pass the same full_every)."""
    stat = os.statvfs(folder)
    free = [stat.f_bavail * stat.f_frsize]
    dist.broadcast_object_list(free, src=0)
    return int(free[0])


def _refused(
    model: nn.Module,
    opt: zs.ZeroOptimizer,
    k: int,
    folder: str,
    rank_state: dict[str, torch.Tensor] | None = None,
) -> str:
    """The ValueError of `Snapshots(full_every=k)`'s first take (or of its construction),
    the same on every rank."""
    snaps = None
    with pytest.raises(ValueError) as refused:
        snaps = Snapshots(model, opt, every=1, full_every=k, rank_state=rank_state, root=folder)
        try:
            snaps.take(1)
        finally:
            assert not list(Path(snaps.store.folder, "slots").glob("*.buf"))  # none made
            snaps.close()
    messages: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(messages, str(refused.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


def _figure(message: str, what: str) -> int:
    found = re.search(rf"\(([\d,]+) bytes\) for {what}", message)
    assert found, message
    return int(found.group(1).replace(",", ""))


def _room(folder: str) -> None:
    """2 ranks, each its own node keeping the other's replica: a node holds 2 slots of
    its rank's full snapshot and 2 replicas of the other's, M bytes each at construction
    (the masters), 3M at the first take (AdamW's moments), and K entries of each, M each
    (their gradients)."""
    model, opt = _engine()
    masters = sum(g.master.nbytes for g in engine_state(engine_module(model)).groups)
    m = _everyone(masters)
    assert m[0] == m[1] == WIDTH * WIDTH * 4
    entries = m[0] + m[1]  # a node's: its rank's and its ward's
    free = _free(folder)
    # At construction: the journal leaves 1M to 3M of the free space, the 4M of the full
    # snapshots' masters do not fit.
    k = (free - m[0]) // entries
    message = _refused(model, opt, k, folder)
    assert message.startswith(f"Snapshots(full_every={k}): rank 0's node needs ")
    assert _figure(message, "full snapshots") == 2 * entries
    assert _figure(message, "the journal") == k * entries
    assert "its masters and buffers: the optimizer's state counted at the first" in message
    assert f"are free in {folder}" in message and "docker run --shm-size" in message
    # At the first take: the journal leaves 8M to 10M, more than the masters' 4M (the
    # construction passes) but less than the 12M that the first snapshot, AdamW's moments
    # in it, lays out: refused before its slots are made.
    x = torch.randn(4, WIDTH)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    k = (free - 8 * m[0]) // entries
    message = _refused(model, opt, k, folder)
    assert "as the first snapshot lays it out" in message
    assert _figure(message, "full snapshots") > 6 * entries
    # The journal leaves 18M to 20M: room for the full snapshots, with a rank's state of
    # M bytes in them (16M), as construction priced the entries (M each); at the first
    # take the entries hold that state too, and the journal is twice that.
    k = (free - 18 * m[0]) // entries
    mine = {"state": torch.zeros(WIDTH * WIDTH)}
    message = _refused(model, opt, k, folder, mine)
    assert _figure(message, "the journal") > 2 * k * entries
    # A journal that leaves room for them is taken.
    snaps = Snapshots(model, opt, every=1, full_every=2, rank_state=mine, root=folder)
    try:
        assert snaps.take(1)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert snaps.take(2)  # an entry
        snaps.wait()
    finally:
        snaps.close()


def test_snapshots_refuse_a_node_without_room(tmp_path: Path) -> None:
    """The full snapshots beside the journal: refused at construction and at the first
    take (the optimizer's state; a rank's state in every entry), on every rank with the
    same message naming the node, the figures, the free space, the folder and the ways
    out; taken where they fit."""
    run_ranks(_room, 2, str(tmp_path))


def _shm_bytes() -> int:
    """The size of the tmpfs at /dev/shm (0 if it is none, or one of no set size)."""
    with open("/proc/mounts") as mounts:
        if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts):
            return 0
    stat = os.statvfs("/dev/shm")
    return stat.f_blocks * stat.f_frsize


@pytest.mark.skipif(_shm_bytes() == 0, reason="needs /dev/shm as a tmpfs of a set size")
def test_a_slot_without_room_is_a_named_error(tmp_path: Path) -> None:
    """A slot or a replica larger than the whole tmpfs: `posix_fallocate` raises ENOSPC
    (for real: tmpfs refuses at once, reserving nothing) and the snapshot's file is a
    RuntimeError naming it, its size and the ways out; no file is left."""
    folder = Path("/dev/shm") / f"zeroshard-room-test-{os.getpid()}"
    size = _shm_bytes() + (1 << 20)
    try:
        store = NodeStore(folder)
        with pytest.raises(RuntimeError, match=r"no room for rank 0's snapshot slot of .* GiB"):
            Slots(store, 0, pin=False).next(size)
        assert not list((folder / "slots").iterdir())
        with pytest.raises(RuntimeError, match=r"no room for rank 1's replica of step 3 .*--shm"):
            Replicas(store, 0, [1], 1).place(3, 1, 2, size, False, None)
        assert not list((folder / "step-3").iterdir())
    finally:
        NodeStore(folder).remove()


SMALL_WIDTH = 512  # 1 MiB of masters per rank, a full snapshot of AdamW's about 3 MiB
TMPFS_MIB = 64  # Docker's default /dev/shm


def _ballast(root: Path, leave: int) -> None:
    """Fill the filesystem of `root` but `leave` bytes (a file of reserved pages)."""
    stat = os.statvfs(root)
    size = stat.f_bavail * stat.f_frsize - leave
    fd = os.open(root / "ballast", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _small_tmpfs(folder: str) -> None:
    """On a real tmpfs of 64 MiB shared by both ranks' "nodes": refused at the first take
    when 10 MiB are left (each node's 12 MiB do not fit; the masters' 4 MiB did at
    construction); taken when there is room, then, the tmpfs filled after the check, the
    next snapshot's replica is a named RuntimeError on every rank, not a SIGBUS."""
    root = Path(folder)
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(SMALL_WIDTH, SMALL_WIDTH, bias=False),
        nn.Linear(SMALL_WIDTH, SMALL_WIDTH, bias=False),
    )
    model, opt = zs.initialize(plain, torch.optim.AdamW(plain.parameters()), {"stage": 2})
    model(torch.randn(4, SMALL_WIDTH)).square().mean().backward()
    opt.step()
    if dist.get_rank() == 0:
        _ballast(root, 10 << 20)
    dist.barrier()
    message = _refused(model, opt, 1, folder)
    assert "as the first snapshot lays it out" in message and f"free in {folder}" in message
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "ballast").unlink()
    dist.barrier()
    snaps = Snapshots(model, opt, every=1, root=folder)
    assert snaps.take(1)
    snaps.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        _ballast(root, 1 << 20)  # less than a replica
    dist.barrier()
    with pytest.raises(RuntimeError, match=r"no room for rank \d's replica of step 2 .*--shm"):
        assert snaps.take(2)
        snaps.wait()
    snaps.close()  # the files are removed
    assert [p.name for p in root.iterdir()] == ["ballast"]


def _namespaces() -> bool:
    """Whether this user may make a user and mount namespace (to mount a tmpfs)."""
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _namespaces(), reason="needs unshare -Urm (to mount a small tmpfs)")
def test_a_small_tmpfs_is_refused_or_named(tmp_path: Path) -> None:
    """`_small_tmpfs` in a user and mount namespace of its own (`unshare -Urm`), where a
    tmpfs of Docker's default size is mounted: real `statvfs`, real ENOSPC."""
    shm = tmp_path / "shm"
    shm.mkdir()
    body = f"from tests.engine.test_snapshots_room import _run_small; _run_small({str(shm)!r})"
    script = f"mount -t tmpfs -o size={TMPFS_MIB}m tmpfs {shm} && exec {sys.executable} -c {body!r}"
    done = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _run_small(folder: str) -> None:
    run_ranks(_small_tmpfs, 2, folder)
