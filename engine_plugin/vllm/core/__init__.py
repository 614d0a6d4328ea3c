"""The vLLM connector's logic that imports no engine: the scheduler side's decisions
(scheduler_side.py, handoff, hints, prefetch), the step plan, and the worker side's loads,
saves and stages over the engine-neutral data plane (connectors/)."""
