"""The planned attention path: one metadata check per pass, padded SDPA for many short runs."""
import pytest
import torch

from specforge_kernels import planned_attention as pa
from specforge_kernels import varlen_attention as va


def _case(dtype, runs, slots, starts, S=16, T=256, hq=9, hkv=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(S, hkv, T, d, generator=g).to(dtype)
    vc = torch.randn(S, hkv, T, d, generator=g).to(dtype)
    q = torch.randn(sum(runs), hq + hkv, d, generator=g).to(dtype)[:, :hq]  # strided, as in the model
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(runs), 0).tolist()])
    return q, kc, vc, cu, torch.tensor(slots), torch.tensor(starts)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("runs,slots,starts", [
    ([1] * 16, list(range(16)), [10 + 7 * i for i in range(16)]),      # aligned decode
    ([3, 1, 6, 2], [5, 0, 9, 3], [50, 100, 20, 70]),                     # gathered verify
    ([4] * 8, list(range(8)), [30 + 11 * i for i in range(8)]),         # aligned, merged GQA rows
    ([6], [3], [100]),                                                   # one request verifying
])
@pytest.mark.parametrize("batched", [None, True, False])
def test_planned_matches_reference(dtype, tol, runs, slots, starts, batched):
    q, kc, vc, cu, sl, sp = _case(dtype, runs, slots, starts)
    ref = va.varlen_attention_reference(q, kc, vc, cu, sl, sp, 0.125)
    plan = pa.plan_varlen_attention(cu, sl, sp, kc, q.shape[0], q.shape[1], batched)
    torch.testing.assert_close(pa.varlen_attention_planned(q, kc, vc, plan, 0.125), ref, atol=tol, rtol=tol)
    if batched is False or (batched is None and dtype == torch.float32):
        assert plan.padded is None  # float32 stays bit-identical to the reference
        assert torch.equal(pa.varlen_attention_planned(q, kc, vc, plan, 0.125), ref)


def test_freed_slots_are_cleared_before_they_are_handed_out_again():
    """A freed slot's leftovers (here NaN) never reach its next occupant's padded reads; every
    slot freed since is cleared in the same pass."""
    from specforge.runtime.torch.cache import KVCache
    cache = KVCache(2, 3, 1, 16, 4, torch.bfloat16)
    slots = [cache.allocate() for _ in range(3)]
    cache.note_written(slots, [5, 7, 3])
    for t in (*cache.k, *cache.v):
        for slot, end in zip(slots, [5, 7, 3]):
            t[slot, :, :end] = float("nan")
    cache.free(slots[2])
    cache.free(slots[0])
    assert cache.allocate() == slots[0]
    for t in (*cache.k, *cache.v):
        assert torch.isfinite(t[[slots[0], slots[2]]]).all()
        assert torch.isnan(t[slots[1], :, :7]).all()  # still in use: untouched


def test_mixed_lengths_are_grouped_by_slot_and_nobody_pays_for_the_longest():
    """Short runs over contexts of mixed lengths: neighbouring slots of alike lengths share a padded
    SDPA, a long context stays alone, a prefill chunk takes its own call — and the result is the
    reference's (bf16 tolerance)."""
    contexts = [100, 120, 90, 2000, 110, 95, 105, 130]  # slot i holds request i's context
    runs = [1, 1, 1, 1, 4, 4, 4, 4]
    runs_with_chunk = runs + [40]  # a chunked prefill in the same pass
    q, kc, vc, cu, sl, sp = _case(torch.bfloat16, runs_with_chunk, list(range(9)), contexts + [64], S=12, T=2100)
    plan = pa.plan_varlen_attention(cu, sl, sp, kc, q.shape[0], q.shape[1])
    assert plan.padded is None and plan.groups
    assert 8 in plan.alone  # the prefill chunk
    for p in plan.groups:  # no group reads the long context's 2,000 keys for a short neighbour
        assert p.span == 1 or p.length < 200, (p.span, p.length)
    read = sum(p.span * p.length for p in plan.groups) + sum(contexts[r] + runs[r] for r in plan.alone if r < 8)
    assert read <= 1.3 * sum(c + n for c, n in zip(contexts, runs))  # ~ the requests' own keys
    ref = va.varlen_attention_reference(q, kc, vc, cu, sl, sp, 0.125)
    torch.testing.assert_close(pa.varlen_attention_planned(q, kc, vc, plan, 0.125), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(6))
def test_random_passes_match_the_reference_whatever_the_grouping(seed):
    import random
    rng = random.Random(seed)
    n_req = rng.randint(2, 12)
    slots = rng.sample(range(16), n_req)
    runs = [rng.choice([1, 1, 2, 5, 8, 20]) for _ in range(n_req)]
    starts = [rng.choice([0, 3, 40, 150, 900]) for _ in range(n_req)]
    q, kc, vc, cu, sl, sp = _case(torch.bfloat16, runs, slots, starts, T=1024, seed=seed)
    plan = pa.plan_varlen_attention(cu, sl, sp, kc, q.shape[0], q.shape[1])
    ref = va.varlen_attention_reference(q, kc, vc, cu, sl, sp, 0.125)
    torch.testing.assert_close(pa.varlen_attention_planned(q, kc, vc, plan, 0.125), ref, atol=2e-2, rtol=2e-2)


def test_a_float32_cache_stays_exact_unless_told_otherwise():
    """A float32 cache is the parity dtype: per-request calls, bit-identical to the reference.
    ``exact=False`` (a float32 cache under a bf16 model) groups it like a bf16 one, within float32
    rounding of the reference."""
    q, kc, vc, cu, sl, sp = _case(torch.float32, [1] * 8 + [4] * 4, list(range(12)), [40 + 3 * i for i in range(12)])
    exact = pa.plan_varlen_attention(cu, sl, sp, kc, q.shape[0], q.shape[1])
    assert exact.padded is None and not exact.groups
    grouped = pa.plan_varlen_attention(cu, sl, sp, kc, q.shape[0], q.shape[1], exact=False)
    assert grouped.padded is not None or grouped.groups
    ref = va.varlen_attention_reference(q, kc, vc, cu, sl, sp, 0.125)
    assert torch.equal(pa.varlen_attention_planned(q, kc, vc, exact, 0.125), ref)
    torch.testing.assert_close(pa.varlen_attention_planned(q, kc, vc, grouped, 0.125), ref, atol=1e-5, rtol=1e-5)
