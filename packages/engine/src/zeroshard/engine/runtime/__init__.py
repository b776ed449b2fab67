"""What runs inside a training step: flat groups and their storage, stage-3 units and the
hooks that gather and release them, the gradient reducer, the optimizer on the master
shards, CPU offload, mixed precision, loss scaling, and the `EngineState` that ties them
to a model. Imports only `config`."""
