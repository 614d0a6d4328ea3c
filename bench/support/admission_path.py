"""The path of `learned` disk admission's threshold over a replay: what the loss budget
(kvstore/tiers/loss_budget.py) asked at each point of the trace's time, and the share of
hits its refusals cost lately, for `kvstore replay`'s plot (bench/commands/plots.py).

A hook of the Replayer (bench/support/replay.py's ServeHooks): after each request it notes
the policy's threshold and measured loss, one point per POINT_S of trace time at most (the
last of each), over every pass; `reset` (the measured pass begins) marks when counting began.
"""

from __future__ import annotations

from typing import Any

from bench.support.replay import Replayer
from bench.support.trace import TraceRequest

POINT_S = 1.0  # trace seconds a point stands for


class ThresholdPath:
    def __init__(self, replayer: Replayer) -> None:
        self.replayer = replayer
        self.time_s: list[float] = []
        self.threshold: list[float] = []
        self.loss: list[float] = []
        self.counted_from_s = 0.0
        replayer.hooks.append(self)

    def before(self, request: TraceRequest) -> None:
        pass

    def after(self, request: TraceRequest) -> None:
        info = self.replayer.policy.describe()
        now = self.replayer.now
        if self.time_s and self.time_s[-1] // POINT_S == now // POINT_S:  # the same point's time
            self.time_s.pop()
            self.threshold.pop()
            self.loss.pop()
        self.time_s.append(now)
        self.threshold.append(info.get("threshold", 0.0))
        self.loss.append(info.get("loss_measured", 0.0))

    def reset(self) -> None:
        self.counted_from_s = self.replayer.now

    def result(self) -> dict[str, Any]:
        budget = self.replayer.policy.describe().get("loss_budget")
        return {"threshold_path": {"time_s": self.time_s, "threshold": self.threshold,
                                   "loss_measured": self.loss, "loss_budget": budget,
                                   "counted_from_s": self.counted_from_s}}
