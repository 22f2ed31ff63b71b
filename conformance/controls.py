"""Negative controls: deliberately lossy components that the conformance suite must reject.

None of them is reachable through an entry point.  A test registers them by hand::

    host = PluginHost(autoload=False)
    host.add_plugin(specforge_conformance.controls, "controls")
    scheduler = host.create_scheduler("retrospective-global", {"sps": [1.0, 0.5, 0.45]})

Each control documents the bug it simulates and which check is expected to catch it.  The single
hook implementation per kind at the bottom of this module registers all controls of that kind.
"""

from __future__ import annotations

from torch import Tensor

from specforge import hookimpl
from specforge_plugins.schedulers.admission import admission_path, global_count
from specforge_plugins.schedulers.hardware_aware import HardwareConfig

__all__ = ["GlobalSearchScheduler"]


# --- schedulers -------------------------------------------------------------------------------


class GlobalSearchScheduler:
    """The retrospective scheduler of paper Appendix A: Algorithm 1 *without* the break.

    It walks the whole admission path of the current round and returns the arg-max of Θ.  Since
    c_{k+1} is computed from x_k, the decision to verify x_k then depends on x_k itself: tokens
    that lead to confident continuations are favoured.  With p = (0.7, 0.3), q = (0.5, 0.5) and
    SPS(1..3) = 1, 0.5, 0.45 the first output token follows (0.85, 0.15) instead of (0.7, 0.3).
    """

    def __init__(self, config: HardwareConfig) -> None:
        self.config = config
        self.profile = config.hardware_profile()

    def schedule(self, confidence: Tensor, available: Tensor) -> Tensor:
        path = admission_path(confidence, available)
        return path.lengths(global_count(path.throughput(self.profile)))


# --- registration -----------------------------------------------------------------------------


@hookimpl
def specforge_register_schedulers(register):
    register("retrospective-global", GlobalSearchScheduler, config=HardwareConfig,
             reads=("confidence", "hardware_profile"),
             description="NEGATIVE CONTROL (lossy): Algorithm 1 without the early-stopping break")
