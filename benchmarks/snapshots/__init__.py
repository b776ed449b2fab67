"""Recovery from memory: the step time with snapshots, and the time to recover."""
