"""One worker of the recovery benchmark, under torchrun: the GPT trained with snapshots
every step; each rank appends one JSON line of wall-clock times to `events.jsonl`.

    torchrun ... -m benchmarks.snapshots._job --steps 8 [--pause 5:NAME] [--width 512 ...]

`--pause S:NAME`: every worker of this agent, at step S of its first attempt, writes its
pid to NAME-{LOCAL_RANK}.pid and sleeps (the benchmark SIGKILLs it with its agent).
The times: `start` (the interpreter started), `pg` (the process group up), `resume`
(`Snapshots.resume` called) and `resumed` (returned, with its `fetch_s` and `load_s`),
`first` (the first step done), all `time.time()`, comparable across the processes of
one host.
"""

from __future__ import annotations

import time

START = time.time()

import argparse  # noqa: E402 - the start time first
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zeroshard.engine as zs  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from zeroshard.comm import init_process_group  # noqa: E402


def main() -> None:
    """Train; log the times; pause where asked."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pause", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    init_process_group("gloo")
    pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = GPTConfig.preset(
        "tiny", d_model=a.width, n_layer=a.layers, n_head=max(1, a.width // 64), seq_len=a.seq
    )
    plain = GPT(cfg)
    model, opt = zs.initialize(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), {"stage": 3})
    data = {"next_step": 0}
    snaps = zs.Snapshots(model, opt, client_state={"data": data}, rank_state={"rng": zs.RNGState()})
    resume = time.time()
    snaps.resume(Path("ck"))
    resumed = time.time()
    data = snaps.client_state["data"]  # type: ignore[index]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    pause = a.pause.split(":") if a.pause else None
    first = None
    g = torch.Generator().manual_seed(1)
    per = a.batch // world
    for step in range(data["next_step"], a.steps):
        if pause is not None and attempt == 0 and step == int(pause[0]):
            Path(f"{pause[1]}-{os.environ['LOCAL_RANK']}.pid").write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        g.manual_seed(step)
        idx = torch.randint(0, cfg.vocab_size, (a.batch, a.seq + 1), generator=g)
        mine = idx[rank * per : (rank + 1) * per]
        model(mine[:, :-1], mine[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        data["next_step"] = step + 1
        snaps.take(step + 1)
        if first is None:
            first = time.time()
    last = snaps.last_resume
    assert last is not None
    row = {
        "rank": rank,
        "attempt": attempt,
        "node": os.environ.get("GROUP_RANK"),
        "start": START,
        "pg": pg,
        "resume": resume,
        "resumed": resumed,
        "first": first,
        "source": last.source,
        "step": last.step,
        "fetch_s": last.fetch_s,
        "load_s": last.load_s,
        "fetched_bytes": last.fetched_bytes,
    }
    with open("events.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    snaps.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
