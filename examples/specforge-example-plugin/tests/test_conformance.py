"""The budget scheduler through specforge's conformance suite (its pytest plug-in).

The fixture comes with specforge; nothing here knows how the suite works.  ``budget`` is found
through this package's entry point and checked in every kind of pipeline it can be part of.
Run ``pytest --specforge-full`` for the full tier.
"""


def test_budget_keeps_the_target_distribution(specforge_conformance):
    report = specforge_conformance.check("budget")
    report.assert_passed()
    assert any(c.combination.scheduler == "budget" and c.status == "certified" for c in report.combos)
