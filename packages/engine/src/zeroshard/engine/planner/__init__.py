"""The planner: `estimate()` and the `zeroshard-plan` command predict a run's per-rank
memory and step time from a meta-device model, calling the runtime's own rules for what
`initialize()` would build. Imports `config` and `runtime`; nothing imports it but the
engine's public face."""
