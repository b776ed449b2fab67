"""fp8 against bf16 training on real text, loss curve by loss curve: `-m benchmarks.float8_loss`."""
