"""`zeroshard-plan --tp N`: what tensor parallelism splits on each rank and the
collectives of a micro-batch, for the `tiny` GPT preset (vocab 256, d 256, 4 blocks, MLP
1024, seq 128, tied head), counted by hand below; the model states against a real
engine are checked in test_tensor_parallel_state."""

from __future__ import annotations

import pytest

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._cluster import Cluster
from zeroshard.engine.planner._presets import build
from zeroshard.engine.planner._tensor_parallel import plan_tensor_parallel

# Split over tp: the (tied) embedding 256 x 256 and, per block, qkv (768 x 256 + 768),
# the attention projection's weight (256 x 256), fc (1024 x 256 + 1024), the MLP
# projection's weight (256 x 1024). Whole on every rank: the positions (128 x 256), per
# block two LayerNorms (2 x 512) and two projection biases (2 x 256), the last LayerNorm.
SPLIT = 256 * 256 + 4 * (768 * 256 + 768 + 256 * 256 + 1024 * 256 + 1024 + 256 * 1024)
WHOLE = 128 * 256 + 4 * (2 * 512 + 2 * 256) + 512


@pytest.mark.parametrize("sp", [False, True])
def test_tiny_preset_split_and_collectives(sp: bool) -> None:
    cfg = ZeroConfig.from_dict({"stage": 3, "compute_dtype": "bf16"})
    plan = plan_tensor_parallel(
        build("tiny", activation_checkpointing=False),
        cfg,
        world_size=8,
        tp=2,
        micro_batch=2,
        seq_len=128,
        sequence_parallel=sp,
        cluster=Cluster(),
    )
    assert (plan.split, plan.per_rank, plan.parameters) == (
        SPLIT,
        SPLIT // 2 + WHOLE,
        SPLIT + WHOLE,
    )
    assert plan.dp == 4
    # 4 bytes of fp32 master per element a rank holds, sharded over dp 4, and the flat
    # groups' alignment padding (8 bf16 elements a slot at most).
    assert plan.per_rank <= plan.states["master"] < plan.per_rank + 4096
    ops = {(c.layer, c.phase, c.op): (c.count, c.nbytes) for c in plan.collectives}
    activation = 2 * 128 * 256 * 2  # [micro-batch, seq, d] in bf16
    if not sp:
        # Per block: the two rowwise outputs all-reduced in forward, the two colwise
        # inputs' gradients in backward; the embedding's output; the head's gathered
        # logits and its input's gradient.
        assert ops == {
            ("tok_emb", "forward", "all-reduce"): (1, activation),
            ("blocks.*.attn.proj", "forward", "all-reduce"): (4, activation),
            ("blocks.*.mlp.proj", "forward", "all-reduce"): (4, activation),
            ("blocks.*.attn", "backward", "all-reduce"): (4, activation),
            ("blocks.*.mlp", "backward", "all-reduce"): (4, activation),
            ("head", "forward", "all-gather"): (1, 2 * 128 * 256 * 2),
            ("head", "backward", "all-reduce"): (1, activation),
        }
        return
    assert ops[("blocks.*.attn", "forward", "all-gather")] == (4, activation)
    assert ops[("blocks.*.attn", "backward", "reduce-scatter")] == (4, activation)
    assert ops[("blocks.*.mlp.proj", "forward", "reduce-scatter")] == (4, activation)
    assert ops[("blocks.*.mlp.proj", "backward", "all-gather")] == (4, activation)
    # Each LayerNorm's weight and bias gradients (Partial over tp), 256 bf16 each.
    assert ops[("blocks.*.ln1", "backward", "all-reduce")] == (8, 256 * 2)
    assert sum(c.count for c in plan.collectives) == 4 * 12 + 2 + 3 + 2
    assert plan.tp_seconds > 0


def test_cli_prints_the_split_and_refuses_what_it_cannot_price(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["tiny", "--world", "4", "--tp", "2", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tp 2, sequence parallel x dp 2" in out and "tensor-parallel collectives" in out
    # Offload under tensor parallelism: each rank's host holds its pieces' share.
    assert main(["tiny", "--world", "4", "--tp", "2", "--stage", "3", "--offload", "params"]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer + params" in out and "| host (offload), of it pinned |" in out
    for argv, why in [
        (["--tp", "3"], "--tp 3 does not divide --world 4"),
        (["--sequence-parallel"], "--sequence-parallel needs --tp above 1"),
        (["--tp", "2", "--snapshots", "64"], "--tp cannot be combined with --snapshots"),
    ]:
        assert main(["tiny", "--world", "4", *argv]) == 2
        assert why in capsys.readouterr().err
