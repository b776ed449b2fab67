"""`initialize()`: checks its inputs, makes the ranks agree on them, materializes meta
models unit by unit, and builds the runtime on the model, with the `state_dict` hooks of
`state`. Imports `config`, `runtime` and `state`."""
