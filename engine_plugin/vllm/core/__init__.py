"""The vLLM connector's logic that imports no engine: the scheduler side's decisions
(scheduler_side.py over prompt_lookups, leases, step_planner, handoff, hints, prefetch),
the step plan, and the worker side's loads, saves and stages over the engine-neutral
data plane (connectors/)."""
