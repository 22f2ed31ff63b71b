"""The shipped schedulers: ``fixed``, ``threshold``, ``hw-prefix`` and ``async-topk``."""

from __future__ import annotations

from specforge import hookimpl
from specforge_plugins.schedulers.hardware_aware import (
    AsyncTopKConfig,
    AsyncTopKScheduler,
    HardwareConfig,
    HwPrefixScheduler,
)
from specforge_plugins.schedulers.simple import (
    FixedConfig,
    FixedScheduler,
    ThresholdConfig,
    ThresholdScheduler,
)

__all__ = [
    "AsyncTopKConfig",
    "AsyncTopKScheduler",
    "FixedConfig",
    "FixedScheduler",
    "HardwareConfig",
    "HwPrefixScheduler",
    "ThresholdConfig",
    "ThresholdScheduler",
]


# Step curves SPS(B) for the conformance suite: Appendix A's, a flat one (verification is free, so
# everything is admitted), a steep one (admission stops early and depends on the confidences), and
# the steep one with a drafting cost, so that the draft gate opens and closes between rounds.
SPS_EXAMPLES = (
    {"sps": [1.0, 0.5, 0.45]},
    {"sps": [1.0] * 64},
    {"sps": [1.0, 0.8, 0.6, 0.5, 0.42, 0.36, 0.3, 0.25]},
    {"sps": [1.0, 0.8, 0.6, 0.5, 0.42, 0.36, 0.3, 0.25], "draft_cost": 0.4, "probe_every": 2},
)


@hookimpl
def specforge_register_schedulers(register):
    register("fixed", FixedScheduler, config=FixedConfig, reads=(),
             examples=({}, {"length": 1}, {"length": 2}),
             description="verify min(length, available) tokens of every request")
    register("threshold", ThresholdScheduler, config=ThresholdConfig, reads=("confidence",),
             examples=({"theta": 0.2}, {"theta": 0.5}, {"theta": 0.8}),
             description="verify while the calibrated confidence c_k stays ≥ theta")
    register("hw-prefix", HwPrefixScheduler, config=HardwareConfig,
             reads=("confidence", "hardware_profile"), examples=SPS_EXAMPLES,
             description="Algorithm 1: greedy global admission by survival, "
                         "stop when expected throughput stops improving")
    register("async-topk", AsyncTopKScheduler, config=AsyncTopKConfig,
             reads=("confidence", "hardware_profile", "history"),
             examples=SPS_EXAMPLES + ({"sps": [1.0, 0.9, 0.8, 0.6], "initial_capacity": 2},),
             description="§5.2: capacity from an unconstrained search two rounds back, "
                         "filled with the current top-K by survival")
