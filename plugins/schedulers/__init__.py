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


@hookimpl
def specforge_register_schedulers(register):
    register("fixed", FixedScheduler, config=FixedConfig, reads=(),
             description="verify min(length, available) tokens of every request")
    register("threshold", ThresholdScheduler, config=ThresholdConfig, reads=("confidence",),
             description="verify while the calibrated confidence c_k stays ≥ theta")
    register("hw-prefix", HwPrefixScheduler, config=HardwareConfig,
             reads=("confidence", "hardware_profile"),
             description="Algorithm 1: greedy global admission by survival, "
                         "stop when expected throughput stops improving")
    register("async-topk", AsyncTopKScheduler, config=AsyncTopKConfig,
             reads=("confidence", "hardware_profile", "history"),
             description="§5.2: capacity from an unconstrained search two rounds back, "
                         "filled with the current top-K by survival")
