"""Recovery from memory: snapshots of every rank's state in shared memory, each with a
replica on another node, and a restart from the newest step they cover.

    snapshots = zs.Snapshots(model, optimizer, every=1, client_state=..., rank_state=...)
    step = snapshots.resume(ckpt_dir)  # memory first, else the newest checkpoint on disk
    for step in ...:
        ...  # the step, the scheduler, the data position
        snapshots.take(step + 1)
    snapshots.close()

A snapshot holds what a checkpoint holds ([Note: snapshot lifecycle] in `_snapshots`,
[Note: restoring from memory] in `_restore`); docs/reliability.md says what it costs.
"""

from zeroshard.engine.recovery._restore import Resumed
from zeroshard.engine.recovery._snapshots import Snapshots

__all__ = ["Resumed", "Snapshots"]
