"""Schedulers: behaviour, Algorithm 1 exactness, causality, the async lag, and Appendix A."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import specforge_conformance.controls as controls
from specforge.hardware import HardwareProfile
from specforge.plugins import PluginHost
from specforge.registry import ComponentKind
from specforge.toolkit.admission import admission_path

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
# Multi-round properties draw many batches per example; fewer examples keep them to ~1 s.
MULTI_ROUND = settings(SETTINGS, max_examples=60)
APPENDIX_SPS = [1.0, 0.5, 0.45]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    h = PluginHost(autoload=False, strict=False).load()
    assert h.add_plugin(controls, "controls")
    return h


def conf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def avail(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# --- literal references (test-only) -----------------------------------------------------------


def algorithm1_literal(c: list[list[float]], available: list[int], sps) -> list[int]:
    """Algorithm 1 of the paper, line by line, with plain Python floats."""
    R = len(c)
    E = []
    for r in range(R):  # lines 1-3
        a = 1.0
        for j in range(1, available[r] + 1):
            a = a * c[r][j - 1]
            if a > 0:  # line 4: candidate space {(r, j) | a_{r,j} > 0}
                E.append((a, j, r))
    E.sort(key=lambda e: (-e[0], e[1], e[2]))  # line 4: descending a, ties by j then r
    ell = [0] * R  # line 5
    B = R
    tau = float(R)
    theta_best = R * sps(R)  # line 6
    ell_star = [0] * R
    for a, j, r in E:  # line 7
        ell[r] = j  # line 8
        B = B + 1
        tau = tau + a
        theta = tau * sps(B)  # line 9
        if theta > theta_best:  # line 10
            theta_best = theta  # line 11
            ell_star = list(ell)
        else:
            break  # line 13
    return ell_star


def ranked_candidates(c: list[list[float]], available: list[int]) -> list[tuple[float, int, int]]:
    """All (a, j, r) with a > 0 and j ≤ available_r, in admission order."""
    out = []
    for r, row in enumerate(c):
        a = 1.0
        for j in range(1, available[r] + 1):
            a *= row[j - 1]
            if a > 0:
                out.append((a, j, r))
    return sorted(out, key=lambda e: (-e[0], e[1], e[2]))


def global_capacity_literal(c, available, sps) -> int:
    """Arg-max of Θ over the whole admission path (first maximum), as a token count."""
    R = len(c)
    best, best_n, tau = R * sps(R), 0, float(R)
    for n, (a, _, _) in enumerate(ranked_candidates(c, available), start=1):
        tau += a
        theta = tau * sps(R + n)
        if theta > best:
            best, best_n = theta, n
    return best_n


def top_k_literal(c, available, k) -> list[int]:
    ell = [0] * len(c)
    for _, j, r in ranked_candidates(c, available)[:k]:
        ell[r] = max(ell[r], j)
    return ell


# --- strategies --------------------------------------------------------------------------------

# Confidences from a small grid (exact ties, zeros, ones) or anywhere in [0, 1].
confidence_value = st.one_of(
    st.sampled_from([0.0, 0.25, 0.5, 0.8, 0.9, 1.0]),
    st.floats(0.0, 1.0, allow_nan=False),
)


@st.composite
def batches(draw, max_r=5, max_g=6):
    r = draw(st.integers(1, max_r))
    g = draw(st.integers(1, max_g))
    c = [[draw(confidence_value) for _ in range(g)] for _ in range(r)]
    available = [draw(st.integers(0, g)) for _ in range(r)]
    return c, available


@st.composite
def step_curves(draw):
    """SPS lists that are flat, decaying, jagged or short (so extrapolation is exercised)."""
    n = draw(st.integers(1, 12))
    return [draw(st.floats(0.05, 10.0, allow_nan=False)) for _ in range(n)]


def is_prefix_closed_and_capped(ell: torch.Tensor, available: list[int]) -> bool:
    return all(0 <= int(e) <= a for e, a in zip(ell, available))


# --- registration and configs ------------------------------------------------------------------


def test_registered_with_metadata(host):
    regs = host.registry.of_kind(ComponentKind.SCHEDULER)
    assert {"fixed", "threshold", "hw-prefix", "async-topk"} <= set(regs)
    assert regs["fixed"].metadata.reads == ()
    assert regs["threshold"].metadata.reads == ("confidence",)
    assert regs["hw-prefix"].metadata.reads == ("confidence", "hardware_profile")
    assert regs["async-topk"].metadata.reads == ("confidence", "hardware_profile", "history")
    assert regs["hw-prefix"].plugin == "schedulers"
    assert all(regs[n].metadata.description for n in ("fixed", "threshold", "hw-prefix", "async-topk"))


def test_control_is_not_shipped():
    plain = PluginHost(autoload=False).load()
    assert "retrospective-global" not in plain.names(ComponentKind.SCHEDULER)


@pytest.mark.parametrize(
    "name, cfg",
    [
        ("fixed", {"length": -1}),
        ("fixed", {"lenght": 3}),
        ("threshold", {}),
        ("threshold", {"theta": 0.0}),
        ("threshold", {"theta": 1.0}),
        ("hw-prefix", {}),
        ("hw-prefix", {"sps": [1.0], "profile": "x.json"}),
        ("hw-prefix", {"sps": []}),
        ("hw-prefix", {"sps": [1.0, 0.0]}),
        ("async-topk", {"sps": [1.0], "initial_capacity": -1}),
        ("async-topk", {}),
    ],
)
def test_bad_configs_are_rejected(host, name, cfg):
    with pytest.raises(ValidationError):
        host.create_scheduler(name, cfg)


def test_exactly_one_step_curve_source_message(host):
    with pytest.raises(ValidationError, match="exactly one of 'sps'"):
        host.create_scheduler("hw-prefix", {})


def test_profile_file_is_equivalent_to_inline_sps(host, tmp_path):
    path = tmp_path / "sps.json"
    HardwareProfile(APPENDIX_SPS, device="test").save(path)
    from_file = host.create_scheduler("hw-prefix", {"profile": str(path)})
    inline = host.create_scheduler("hw-prefix", {"sps": APPENDIX_SPS})
    assert from_file.profile.points() == inline.profile.points()


def test_a_profile_measured_for_another_target_or_dtype_is_refused_at_bind(host, tmp_path):
    from specforge.hardware import HardwareProfileError
    from specforge.runtime import TargetModel
    from tiny_models import tiny_model

    target = TargetModel(tiny_model("llama", seed=7, vocab=64, eos=None), None, torch.float32)
    for name, measured, problem in ((target.name, "bfloat16", "dtype 'bfloat16' (this pipeline serves 'float32')"),
                                    ("SmolLM2-135M", "float32", "target 'SmolLM2-135M' (this pipeline serves")):
        path = tmp_path / f"{measured}.json"
        HardwareProfile(APPENDIX_SPS, device="test", target=name, dtype=measured).save(path)
        assert HardwareProfile.load(path).dtype == measured
        scheduler = host.create_scheduler("async-topk", {"profile": str(path)})
        with pytest.raises(HardwareProfileError, match=r"profile .* was measured for " + problem.replace("(", r"\(")
                           .replace(")", r"\)")):
            scheduler.bind(target)
    # a profile that does not say what it was measured for (older files, inline points) is taken as is
    plain = tmp_path / "plain.json"
    HardwareProfile(APPENDIX_SPS, device="test").save(plain)
    host.create_scheduler("hw-prefix", {"profile": str(plain)}).bind(target)


def test_missing_profile_file_names_it(host, tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.json"):
        host.create_scheduler("hw-prefix", {"profile": str(tmp_path / "absent.json")})


def test_profile_auto_measures_this_machines_curve_once_and_the_engine_binds_it(host, tmp_path, monkeypatch):
    """``profile: auto``: the engine binds the scheduler to its target, which measures SPS(B) on
    first use and caches it; a second engine reads the cache (nothing measured again)."""
    import specforge.toolkit.step_curve as profiling
    from specforge.engine import Engine, GenerationRequest
    from specforge.runtime import TargetModel
    from tiny_models import tiny_model

    monkeypatch.setenv("SPECFORGE_CACHE_DIR", str(tmp_path))
    target = TargetModel(tiny_model("llama", seed=7, vocab=64, eos=None), None, torch.float32)
    measured = []
    real = profiling.measure_sps
    monkeypatch.setattr(profiling, "measure_sps", lambda *a, **k: measured.append(1) or real(*a, **k, progress=False))

    def engine():
        scheduler = host.create_scheduler("hw-prefix", {"profile": "auto"})
        with pytest.raises(RuntimeError, match="bind"):
            scheduler.schedule(torch.full((1, 2), 0.9), torch.tensor([2]))
        return scheduler, Engine(target, host.create_verifier("rejection", {}), drafter=host.create_drafter("ngram", {}),
                                 correction_head=None, confidence=host.create_confidence("constant", {"value": 0.9}),
                                 calibrator=host.create_calibrator("identity", {}), scheduler=scheduler)

    first, e1 = engine()
    assert measured == [1] and [b for b, _ in first.profile.points()] == list(profiling.AUTO_BATCHES)
    files = sorted(p.name for p in (tmp_path / "profiles").glob("*.json"))
    assert len(files) == 2 and sum("-draft-" in f for f in files) == 1  # the step curve and the drafting cost
    second, e2 = engine()
    assert measured == [1] and second.profile == first.profile
    out = e2.generate([GenerationRequest(prompt_ids=[3, 4, 5], max_new_tokens=6, temperature=0.0)])
    assert len(out[0].token_ids) == 6


# --- input checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cfg", [("fixed", {}), ("threshold", {"theta": 0.5}),
                                       ("hw-prefix", {"sps": [1.0]}), ("async-topk", {"sps": [1.0]})])
def test_input_validation(host, name, cfg):
    s = host.create_scheduler(name, cfg)
    with pytest.raises(ValueError, match="request 0 at position 2"):
        s.schedule(conf([[0.5, 1.5]]), avail([2]))
    with pytest.raises(ValueError, match=r"\[0, G=2\]"):
        s.schedule(conf([[0.5, 0.5]]), avail([3]))
    with pytest.raises(ValueError, match="available must be"):
        s.schedule(conf([[0.5, 0.5]]), avail([1, 1]))
    # Padding past ``available`` may hold anything.
    out = s.schedule(conf([[0.5, float("nan")]]), avail([1]))
    assert out.dtype == torch.int64 and out.shape == (1,)


# --- fixed -------------------------------------------------------------------------------------


def test_fixed(host):
    c = conf([[0.1, 0.2, 0.3], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    a = avail([3, 1, 0])
    assert host.create_scheduler("fixed").schedule(c, a).tolist() == [3, 1, 0]
    assert host.create_scheduler("fixed", {"length": 2}).schedule(c, a).tolist() == [2, 1, 0]
    assert host.create_scheduler("fixed", {"length": 0}).schedule(c, a).tolist() == [0, 0, 0]
    assert host.create_scheduler("fixed", {"length": 9}).schedule(c, a).tolist() == [3, 1, 0]
    assert host.create_scheduler("fixed").schedule(conf([[0.5, 0.5]]), avail([2])).tolist() == [2]


# --- threshold ---------------------------------------------------------------------------------


def test_threshold_stops_at_first_low_confidence(host):
    s = host.create_scheduler("threshold", {"theta": 0.5})
    c = conf([[0.9, 0.5, 0.4, 0.9], [0.4, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9], [0.0] * 4])
    assert s.schedule(c, avail([4, 4, 2, 4])).tolist() == [2, 0, 2, 0]
    assert s.schedule(conf([[0.9]]), avail([0])).tolist() == [0]


@SETTINGS
@given(batches(), st.lists(st.floats(0.01, 0.99), min_size=2, max_size=6))
def test_threshold_is_monotone_in_theta(host, batch, thetas):
    c, available = batch
    outs = [host.create_scheduler("threshold", {"theta": t}).schedule(conf(c), avail(available))
            for t in sorted(thetas)]
    for lo, hi in zip(outs, outs[1:]):
        assert bool((hi <= lo).all())
    assert is_prefix_closed_and_capped(outs[0], available)


# --- hw-prefix ---------------------------------------------------------------------------------


@SETTINGS
@given(batches(), step_curves())
def test_hw_prefix_equals_literal_algorithm1(host, batch, sps):
    c, available = batch
    s = host.create_scheduler("hw-prefix", {"sps": sps})
    out = s.schedule(conf(c), avail(available))
    assert out.dtype == torch.int64
    assert out.tolist() == algorithm1_literal(c, available, s.profile.sps)
    assert is_prefix_closed_and_capped(out, available)


def test_hw_prefix_edge_cases(host):
    flat = host.create_scheduler("hw-prefix", {"sps": [1.0] * 64})
    # A flat step curve makes every token with a > 0 worth verifying.
    c = conf([[0.9, 0.5, 0.0, 0.9], [1.0, 1.0, 1.0, 1.0], [0.3, 0.3, 0.3, 0.3]])
    assert flat.schedule(c, avail([4, 3, 0])).tolist() == [2, 3, 0]
    assert flat.schedule(conf([[0.0, 0.0]] * 3), avail([2, 2, 2])).tolist() == [0, 0, 0]
    assert flat.schedule(conf([[0.7, 0.7]]), avail([0])).tolist() == [0]
    # A purely compute-bound curve (B·SPS(B) constant) never gains from a draft token, not even a
    # certain one: Θ ties, and a tie is a non-improvement.
    bound = host.create_scheduler("hw-prefix", {"sps": [1.0]})
    assert bound.schedule(conf([[1.0, 1.0], [1.0, 1.0]]), avail([2, 2])).tolist() == [0, 0]


def test_hw_prefix_ties_go_to_smaller_j_then_smaller_r(host):
    # Room for exactly one token above B = R: equal survivals, the first request wins.
    s = host.create_scheduler("hw-prefix", {"sps": [1.0, 1.0, 0.9, 0.6]})
    assert s.schedule(conf([[0.9], [0.9]]), avail([1, 1])).tolist() == [1, 0]
    # (0, 2) and (1, 1) tie at a = 0.5; j = 1 goes first.
    path = admission_path(conf([[1.0, 0.5], [0.5, 0.0]]), avail([2, 2]))
    assert list(zip(path.rows.tolist(), path.cols.tolist())) == [(0, 1), (1, 1), (0, 2)]


def test_appendix_a_admissions(host):
    hw = host.create_scheduler("hw-prefix", {"sps": APPENDIX_SPS})
    ctrl = host.create_scheduler("retrospective-global", {"sps": APPENDIX_SPS})
    for c2 in (0.9, 0.0):  # x_1 = A gives c_2 = 0.9, x_1 = B gives c_2 = 0
        assert hw.schedule(conf([[0.8, c2]]), avail([2])).tolist() == [0]
    assert ctrl.schedule(conf([[0.8, 0.9]]), avail([2])).tolist() == [2]
    assert ctrl.schedule(conf([[0.8, 0.0]]), avail([2])).tolist() == [0]


def test_appendix_a_output_law(host):
    """The first emitted token's exact law under each scheduler, with the real rejection rule."""
    if "rejection" not in host.names(ComponentKind.VERIFIER):
        pytest.skip("the `rejection` verifier (plugins/verifiers) is not registered yet")
    verifier = host.create_verifier("rejection")
    p = torch.tensor([0.7, 0.3], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    c2 = {0: 0.9, 1: 0.0}  # token 0 = A, token 1 = B

    def first_token_law(scheduler) -> torch.Tensor:
        law = torch.zeros(2, dtype=torch.float64)
        for x in (0, 1):
            ell = int(scheduler.schedule(conf([[0.8, c2[x]]]), avail([2]))[0])
            if ell >= 1:  # x_1 is verified: accepted w.p. a, else the residual is emitted
                token = torch.tensor(x)
                acc = float(verifier.accept_probability(p, q, token))
                res = verifier.residual(p, q, token).to(torch.float64)
                emit_x = torch.nn.functional.one_hot(token, 2).to(torch.float64)
                law += q[x] * (acc * emit_x + (1 - acc) * res)
            else:  # nothing verified: the target samples the token itself
                law += q[x] * p
        return law

    hw = first_token_law(host.create_scheduler("hw-prefix", {"sps": APPENDIX_SPS}))
    ctrl = first_token_law(host.create_scheduler("retrospective-global", {"sps": APPENDIX_SPS}))
    assert torch.allclose(hw, p, atol=1e-12, rtol=0)
    assert torch.allclose(ctrl, torch.tensor([0.85, 0.15], dtype=torch.float64), atol=1e-12, rtol=0)
    # Sanity of the law itself: with ℓ ≥ 1 for both tokens the rejection rule is exact.
    fixed = first_token_law(host.create_scheduler("fixed"))
    assert torch.allclose(fixed, p, atol=1e-12, rtol=0)


# --- causality ---------------------------------------------------------------------------------


@st.composite
def perturbations(draw):
    """A batch, a request r, a position k ∈ 1..G and new values for c_{r,k+1..G}."""
    c, available = draw(batches())
    r = draw(st.integers(0, len(c) - 1))
    g = len(c[0])
    k = draw(st.integers(1, g))
    changed = [row[:] for row in c]
    changed[r][k:] = [draw(confidence_value) for _ in range(g - k)]
    return c, changed, available, r, k


def admitted(ell: torch.Tensor, r: int, k: int) -> bool:
    return int(ell[r]) >= k


@SETTINGS
@given(perturbations(), step_curves())
def test_hw_prefix_admission_ignores_later_confidences(host, case, sps):
    c, changed, available, r, k = case
    s = host.create_scheduler("hw-prefix", {"sps": sps})
    before = s.schedule(conf(c), avail(available))
    after = s.schedule(conf(changed), avail(available))
    assert admitted(before, r, k) == admitted(after, r, k)


@MULTI_ROUND
@given(batches(), batches(), perturbations(), step_curves(), st.one_of(st.none(), st.integers(0, 12)))
def test_async_topk_admission_ignores_later_confidences(host, h0, h1, case, sps, initial):
    c, changed, available, r, k = case
    outs = []
    for current in (c, changed):
        s = host.create_scheduler("async-topk", {"sps": sps, "initial_capacity": initial})
        for hc, ha in (h0, h1):
            s.schedule(conf(hc), avail(ha))
        outs.append(s.schedule(conf(current), avail(available)))
    assert admitted(outs[0], r, k) == admitted(outs[1], r, k)


def test_breakless_control_violates_causality(host):
    # Only c_2 differs — what a different x_1 does to a pre-token estimator — yet whether x_1 is
    # verified changes.
    ctrl = host.create_scheduler("retrospective-global", {"sps": APPENDIX_SPS})
    high = ctrl.schedule(conf([[0.8, 0.9]]), avail([2]))
    low = ctrl.schedule(conf([[0.8, 0.0]]), avail([2]))
    assert admitted(high, 0, 1) != admitted(low, 0, 1)


# --- async-topk --------------------------------------------------------------------------------


JAGGED = [1.0, 0.98, 0.97, 0.96, 0.6, 0.59, 0.58, 0.57, 0.56, 0.3, 0.3, 0.3]


@MULTI_ROUND
@given(st.lists(batches(max_r=4, max_g=5), min_size=3, max_size=7), step_curves(),
       st.one_of(st.none(), st.integers(0, 10)))
def test_async_topk_lags_two_calls_and_takes_current_top_k(host, rounds, sps, initial):
    s = host.create_scheduler("async-topk", {"sps": sps, "initial_capacity": initial})
    for t, (c, available) in enumerate(rounds):
        out = s.schedule(conf(c), avail(available))
        if t < 2:
            expected_k = initial
        else:
            expected_k = global_capacity_literal(*rounds[t - 2], s.profile.sps)
        assert s.last_capacity == expected_k
        n_candidates = len(ranked_candidates(c, available))
        k = n_candidates if expected_k is None else expected_k
        assert out.tolist() == top_k_literal(c, available, k)
        assert int(out.sum()) == min(k, n_candidates)
        assert is_prefix_closed_and_capped(out, available)


def test_async_topk_capacity_comes_from_two_calls_back(host):
    s = host.create_scheduler("async-topk", {"sps": JAGGED, "initial_capacity": 1})
    ctrl = host.create_scheduler("retrospective-global", {"sps": JAGGED})
    confident = conf([[0.99, 0.99, 0.99, 0.99], [0.99, 0.99, 0.99, 0.99]])
    doubtful = conf([[0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2]])
    a = avail([4, 4])
    # The unconstrained search jumps the SPS cliff for confident drafts and not for doubtful ones.
    k_conf = int(ctrl.schedule(confident, a).sum())
    k_doubt = int(ctrl.schedule(doubtful, a).sum())
    assert k_conf > k_doubt
    seq = [confident, doubtful, doubtful, confident, doubtful]
    caps = []
    for c in seq:
        s.schedule(c, a)
        caps.append(s.last_capacity)
    assert caps == [1, 1, k_conf, k_doubt, k_doubt]


def test_async_topk_initial_capacity_and_forget(host):
    s = host.create_scheduler("async-topk", {"sps": [1.0]})  # initial_capacity = None
    c = conf([[0.9, 0.8, 0.0], [0.5, 0.5, 0.5]])
    a = avail([3, 2])
    # No history yet: every available token with a > 0.
    assert s.schedule(c, a).tolist() == [2, 2]
    assert s.schedule(c, a).tolist() == [2, 2]
    # Compute-bound curve: the search two calls back chose no token.
    assert s.schedule(c, a).tolist() == [0, 0]
    s.forget()
    assert s.schedule(c, a).tolist() == [2, 2]
    assert s.last_capacity is None


def test_async_topk_r1_and_empty(host):
    s = host.create_scheduler("async-topk", {"sps": [1.0] * 16, "initial_capacity": 3})
    assert s.schedule(conf([[0.9, 0.9]]), avail([2])).tolist() == [2]
    assert s.schedule(conf([[0.9, 0.9, 0.9, 0.9]]), avail([4])).tolist() == [3]
    assert s.schedule(conf([[0.0, 0.0]]), avail([2])).tolist() == [0]
    assert s.schedule(conf([[0.9, 0.9]]), avail([0])).tolist() == [0]
