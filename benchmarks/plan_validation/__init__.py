"""The planner against the measured runs and projected: `python -m benchmarks.plan_validation`."""
