"""pytest plug-in (entry point ``pytest11``): conformance checks in a plug-in author's own CI.

Installed with specforge, it gives every pytest session a ``specforge_conformance`` fixture::

    def test_my_scheduler_is_lossless(specforge_conformance):
        specforge_conformance.check("my-scheduler").assert_passed()

``check(*names)`` runs the suite on every combination that uses one of the named components —
discovered through the installed entry points, exactly as ``specforge conformance --plugin``
does — and returns the :class:`~specforge_conformance.suite.SuiteReport`.  ``--specforge-full``
switches to the full tier; ``--specforge-n`` sets the samples per case.  Nothing heavy is imported
until the fixture is used.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("specforge", "specforge conformance")
    group.addoption("--specforge-full", action="store_true", help="run conformance checks at the full tier")
    group.addoption("--specforge-n", type=int, default=None, help="samples per conformance case")


class ConformanceRunner:
    """What the fixture hands to a test."""

    def __init__(self, tier: str, n: int | None) -> None:
        self.tier = tier
        self.n = n

    def check(self, *names: str, seed: int = 0, deterministic: bool = True, host=None, fail_fast: bool = False,
              max_seconds: float | None = None):
        from specforge_conformance.suite import run_suite

        return run_suite(host=host, tier=self.tier, plugins=names, seed=seed, n=self.n,
                         deterministic=deterministic, fail_fast=fail_fast, max_seconds=max_seconds)


@pytest.fixture
def specforge_conformance(request) -> ConformanceRunner:
    config = request.config
    return ConformanceRunner("full" if config.getoption("--specforge-full") else "fast",
                             config.getoption("--specforge-n"))
