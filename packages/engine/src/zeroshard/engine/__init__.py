"""zeroshard.engine: ZeRO stages 1, 2 and 3 with mixed precision, for any torch.optim optimizer.

import zeroshard.engine as zs
model, optimizer = zs.initialize(model, optimizer, {"stage": 2, "compute_dtype": "bf16"})
loss.backward(); optimizer.clip_grad_norm_(1.0); optimizer.step(); optimizer.zero_grad()
full = zs.full_state_dict(model)
zs.full_grad(model, param); zs.grad_norms(model)  # after backward, until zero_grad (collective)
model.state_dict() / model.load_state_dict(full)  # full tensors at every stage (collective)
"""

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.config._deepspeed_config import (
    DeepSpeedSettings,
    hidden_size_of,
    read_deepspeed_config,
    trainer_auto_values,
)
from zeroshard.engine.config._deepspeed_translate import AutoValues
from zeroshard.engine.config._policies import (
    CommPolicy,
    LossScalePolicy,
    OffloadPolicy,
    PrecisionPolicy,
    Stage3Policy,
)
from zeroshard.engine.planner._cluster import Cluster, Link
from zeroshard.engine.planner._estimate import Estimate, estimate
from zeroshard.engine.planner._step_time import Compute
from zeroshard.engine.recovery import Resumed, Snapshots
from zeroshard.engine.runtime._collectives import (
    average_replicas,
    gather_shards,
    reduce_scatter_grads,
)
from zeroshard.engine.runtime._float8_gather import Float8Wire, float8_wire
from zeroshard.engine.runtime._home import Home, HomeKind
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.runtime._stage3 import DivergentRanksError
from zeroshard.engine.runtime._state import (
    EngineModel,
    EngineState,
    WrapsEngineModel,
    engine_state,
    engine_stats,
)
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._wire import ComputeCast, Wire, WireKind
from zeroshard.engine.setup._initialize import initialize
from zeroshard.engine.state._checkpoint import load_checkpoint, save_checkpoint
from zeroshard.engine.state._gathered import gathered_parameters
from zeroshard.engine.state._introspect import full_grad, full_optimizer_state, grad_norms
from zeroshard.engine.state._load import LoadReport, SafetensorsLoadError, load_safetensors
from zeroshard.engine.state._masters import full_state_dict
from zeroshard.engine.state._module_state import state_dict_on_rank0
from zeroshard.engine.state._resume import resume_checkpoint
from zeroshard.engine.state._rng import RNGState
from zeroshard.engine.state._user_state import Stateful

__all__ = [
    "AutoValues",
    "Cluster",
    "CommPolicy",
    "Compute",
    "ComputeCast",
    "DeepSpeedSettings",
    "DivergentRanksError",
    "EngineModel",
    "EngineState",
    "EngineStats",
    "Estimate",
    "Float8Wire",
    "Home",
    "HomeKind",
    "Link",
    "LoadReport",
    "LossScalePolicy",
    "OffloadPolicy",
    "PrecisionPolicy",
    "RNGState",
    "Resumed",
    "SafetensorsLoadError",
    "Snapshots",
    "Stage3Policy",
    "Stateful",
    "Wire",
    "WireKind",
    "WrapsEngineModel",
    "ZeroConfig",
    "ZeroOptimizer",
    "average_replicas",
    "engine_state",
    "engine_stats",
    "estimate",
    "float8_wire",
    "full_grad",
    "full_optimizer_state",
    "full_state_dict",
    "gather_shards",
    "gathered_parameters",
    "grad_norms",
    "hidden_size_of",
    "initialize",
    "load_checkpoint",
    "load_safetensors",
    "read_deepspeed_config",
    "reduce_scatter_grads",
    "resume_checkpoint",
    "save_checkpoint",
    "state_dict_on_rank0",
    "trainer_auto_values",
]
