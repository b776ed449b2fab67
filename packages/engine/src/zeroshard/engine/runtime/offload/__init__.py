"""CPU offload: the fp32 masters, gradients and optimizer state of flat groups on the host,
and the host steps of those masters (serial, in backward, delayed). Part of the runtime:
the core reaches it through the interfaces it defines, never the other way."""
