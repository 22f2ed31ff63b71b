"""The hidden-head drafter through specforge's conformance suite: drafting with the law it reports,
whatever its (random) weights.  Training it is shown by specforge's own test of this package."""


def test_hidden_head_keeps_the_target_distribution(specforge_conformance):
    report = specforge_conformance.check("hidden-head")
    report.assert_passed()
    assert any(c.combination.drafter == "hidden-head" and c.status == "certified" for c in report.combos)
