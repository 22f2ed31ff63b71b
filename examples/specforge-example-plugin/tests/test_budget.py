"""Tests the example plug-in as its own CI would: installed, discovered, selected, correct."""

import json
import subprocess
import sys

import pytest
import torch

from specforge.config import load_pipeline
from specforge.plugins import PluginHost
from specforge_example.plugin import BudgetConfig, BudgetScheduler


def test_discovered_through_the_entry_point():
    host = PluginHost().load()
    reg = host.get("scheduler", "budget")
    assert reg.package == "specforge-example-plugin"
    assert reg.plugin == "example"
    assert reg.metadata.reads == ("confidence",)
    assert not [f for f in host.failures if f.package == "specforge-example-plugin"]


def test_listed_by_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "specforge", "plugins", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    names = {(c["kind"], c["name"], c["package"]) for c in json.loads(out)["components"]}
    assert ("scheduler", "budget", "specforge-example-plugin") in names


def test_selectable_in_a_pipeline(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("scheduler: {name: budget, tokens: 3}\n")
    pipeline = load_pipeline([str(cfg)])
    scheduler = pipeline.component("scheduler").create()
    assert isinstance(scheduler, BudgetScheduler) and scheduler.tokens == 3


def test_spends_the_budget_on_the_highest_survival():
    sched = BudgetScheduler(BudgetConfig(tokens=3))
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.5, 0.9, 0.9]])
    # survival: r0 = .9 .81 .729, r1 = .5 .45 .405 -> top three all in request 0
    assert sched.schedule(conf, torch.tensor([3, 3])).tolist() == [3, 0]
    assert sched.schedule(conf, torch.tensor([1, 3])).tolist() == [1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_admitted_sets_are_prefixes_and_causal(seed):
    g = torch.Generator().manual_seed(seed)
    r, gamma = 4, 5
    conf = torch.rand(r, gamma, generator=g)
    avail = torch.randint(0, gamma + 1, (r,), generator=g)
    sched = BudgetScheduler(BudgetConfig(tokens=int(torch.randint(0, 12, (1,), generator=g))))
    lengths = sched.schedule(conf, avail)
    assert (lengths <= avail).all() and int(lengths.sum()) == min(sched.tokens, int(avail.sum()))
    # Causality: position k of request i is verified iff lengths[i] > k.  A different x_k can only
    # change the confidences of positions after k; that must never change this decision.
    for i in range(r):
        for k in range(gamma - 1):
            changed = conf.clone()
            changed[i, k + 1 :] = torch.rand(gamma - k - 1, generator=g)
            assert bool(sched.schedule(changed, avail)[i] > k) == bool(lengths[i] > k)
