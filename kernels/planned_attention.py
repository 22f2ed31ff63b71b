"""Planned attention: the production CPU path of :mod:`specforge_kernels.varlen_attention`.

A transformer calls attention once per layer with the same ``cu_seqlens``/``slots``/``start_pos``;
:func:`plan_varlen_attention` checks them and copies them to the host once per pass, and lays out
short runs (decode and verify rows) as padded masked SDPAs over groups of neighbouring cache slots
of similar lengths; :func:`varlen_attention_planned` then runs every layer from the plan.  It
computes the same function as the torch twin, :func:`varlen_attention_reference` (tests/
test_planned_attention.py checks it there), which remains the specification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specforge_kernels.varlen_attention import attend_per_request, host_meta, tree_bits

__all__ = ["VarlenPlan", "plan_varlen_attention", "varlen_attention_planned"]

@dataclass(frozen=True)
class _Padded:
    """Layout of one padded SDPA: every slot of ``base..base+P-1`` is one row of the batch."""

    base: int
    span: int  # P
    n_max: int
    length: int  # keys 0..length-1 of each slot are read (masked per row)
    q_index: Tensor | None  # [P * n_max] flat row of q feeding each padded query; None: a view
    out_index: Tensor | None  # [n] padded row of each of the group's tokens; None: a plain reshape
    mask: Tensor  # [P, 1, n_max, length] bool (or [P, 1, G·n_max, length] if merged), True: visible
    merged: bool  # GQA groups folded into query rows (see varlen_attention_planned)


@dataclass(frozen=True)
class VarlenPlan:
    """Host-side launch metadata of one flattened pass, validated once and reused by every layer.

    A transformer calls attention once per layer with the same ``cu_seqlens``/``slots``/
    ``start_pos``; :func:`varlen_attention_reference` re-validates them and copies them to the
    host on every call, a plan does that once per pass (and builds the padded layouts once).

    Exactly one of three layouts: ``padded`` — the whole pass in one padded SDPA; ``groups`` —
    several padded SDPAs over slot-contiguous groups of requests, plus the requests of ``alone``
    (lone decode tokens, prefill chunks) one SDPA each, their outputs concatenated in that order
    and read back into flat token order by one gather (``gather``); neither — one SDPA per request.
    """

    cu: list[int]
    slots: list[int]
    start: list[int]
    padded: _Padded | None
    tree: Tensor | None = None  # [N] int64 bitmasks of a tree pass (always the per-request path)
    groups: tuple[_Padded, ...] = ()
    alone: tuple[int, ...] = ()
    gather: Tensor | None = None  # [N]: row of the concatenated outputs holding flat token i


# Decode and verify runs are short: up to this many tokens per request go through a padded SDPA.
_PADDED_MAX_RUN = 16

# The cost model that groups requests (see _group_by_slot), in ns on one core: an SDPA over
# P slots × L keys with n query rows per slot costs about P·L·(52 + 11·n), plus a fixed cost per
# call — ~14 µs for a lone decode token (views, launch), ~30 µs for a padded group (its mask, the
# gather of its queries, its share of the final gather).  Fitted on SmolLM2's heads, bf16, Intel
# Xeon AMX, 1 thread: 64 ns a key for decode rows whether padded or alone, 98 / 137 ns for merged
# verify rows of n = 4 / 8 (one SDPA per request: 200 / 236).  So decode tokens are grouped only
# to save calls, verify runs also for the cheaper merged rows.  Only ratios matter: how many keys
# of padding one saved call is worth.
_ALONE_NS = 14_000
_GROUP_NS = 30_000


def _group_cost(span: int, length: int, n_max: int, members: int) -> int:
    fixed = _ALONE_NS if members == 1 and n_max == 1 else _GROUP_NS
    return fixed + span * length * (52 + 11 * n_max)


def plan_varlen_attention(
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    k_cache: Tensor,
    n_tokens: int,
    q_heads: int,
    batched: bool | None = None,
    tree: Tensor | None = None,
    exact: bool | None = None,
) -> VarlenPlan:
    """Validate the metadata of an ``n_tokens`` pass (``q_heads`` query heads) against
    ``k_cache``'s shape and plan it.

    ``batched=None`` (unless ``exact``) groups the short runs (decode/verify, not
    prefill) of requests whose cache slots are neighbours into padded SDPAs — as few calls as
    pays, with as little key padding as pays: each group is padded only to its own longest
    request, so a pass over mixed context lengths costs about the sum of the requests' own
    lengths, not R × the longest (:func:`_group_by_slot`).  Per-request SDPA calls cost ~15 µs
    each (×R per layer); one masked SDPA over ``[P, H, n_max, L]`` costs less when the lengths
    are alike, and with the GQA heads folded into query rows verify runs take about half the time
    (measured on SmolLM2 shapes, bf16, 1 core).  One request verifying several tokens behind its
    prefix gains from the merged layout alone.

    The result agrees with the per-request path to a few ulps, not bit for bit: masked keys add
    exact zeros, but the kernel blocks the longer padded key range differently.  So in bf16 a
    request's output then depends, at that level, on its batch-mates' lengths.  float32, the
    parity dtype against Hugging Face, stays on the per-request path, bit-identical to
    :func:`varlen_attention_reference`: ``exact`` (default: whether the cache is float32) keeps
    ``batched=None`` there.  A float32 cache under a bf16 model (faster decode attention on some
    CPUs, see ``specforge.runtime.torch.kv_dtype``) passes ``exact=False``: no parity is at stake, and
    grouping pays there too.  ``True`` forces one padded SDPA for the whole pass, ``False`` the
    per-request path (batch-invariant).

    The padded path reads keys past a request's own length (masked).  A NaN or inf there would
    poison the row (0 × NaN), so it needs the slot's stale entries to be finite; the runtime's
    :class:`~specforge.runtime.torch.cache.KVCache` clears what a request wrote when its slot is freed.
    """
    n_slots, hkv, capacity, _ = k_cache.shape
    group = max(1, q_heads // hkv)
    cu, sl, sp = host_meta(n_tokens, n_slots, capacity, cu_seqlens, slots, start_pos)
    if tree is not None:  # tree passes are rare (tree drafters only): the per-request masked path
        return VarlenPlan(cu, sl, sp, None, tree_bits(tree, n_tokens))
    device = cu_seqlens.device
    if batched is None:
        runs = [cu[r + 1] - cu[r] for r in range(len(sl))]
        if exact is None:
            exact = k_cache.dtype == torch.float32
        if (len(sl) >= 2 or (sl and runs[0] > 1 and sp[0] > 0)) and not exact and len(set(sl)) == len(sl):
            short = [r for r in range(len(sl)) if 0 < runs[r] <= _PADDED_MAX_RUN]
            grouped = _group_by_slot(short, runs, sl, sp)
            alone = tuple(r for r in range(len(sl)) if runs[r] > _PADDED_MAX_RUN)
            if len(grouped) == 1 and len(grouped[0]) == len(sl):
                return VarlenPlan(cu, sl, sp, _plan_padded(cu, sl, sp, device, group, range(len(sl))))
            # A lone decode token needs no mask: its own SDPA (the per-request path) is as cheap.
            padded = [g for g in grouped if len(g) > 1 or runs[g[0]] > 1]
            if padded:
                alone += tuple(g[0] for g in grouped if len(g) == 1 and runs[g[0]] == 1)
                alone = tuple(sorted(alone))
                groups = tuple(_plan_padded(cu, sl, sp, device, group, g) for g in padded)
                return VarlenPlan(cu, sl, sp, None, groups=groups, alone=alone,
                                  gather=_gather_index(cu, padded, groups, alone).to(device))
    elif batched and sl and len(set(sl)) == len(sl) and min(cu[r + 1] - cu[r] for r in range(len(sl))) > 0:
        return VarlenPlan(cu, sl, sp, _plan_padded(cu, sl, sp, device, group, range(len(sl))))
    return VarlenPlan(cu, sl, sp, None)


def _group_by_slot(reqs: list[int], runs: list[int], sl: list[int], sp: list[int]) -> list[list[int]]:
    """Split ``reqs`` into groups of neighbouring cache slots, minimising the modelled cost.

    A padded SDPA reads a contiguous range of slots as a view (never a copy), so a group is a run
    of requests in slot order; it costs one call plus its span × its longest context × its rows
    (:func:`_group_cost`; a free slot inside the span is a padding row).  The best split is a
    shortest path over the slot order — O(R²) with running maxima, well under a millisecond for
    R = 64, once per pass.  A long request next to short ones ends up alone, so nobody pays for it.
    """
    order = sorted(reqs, key=lambda r: sl[r])
    n = len(order)
    best = [0] * (n + 1)  # best[j]: cost of the first j requests
    cut = [0] * (n + 1)  # the group ending at j - 1 starts at cut[j]
    for j in range(1, n + 1):
        length = n_max = 0
        best[j] = -1
        for i in range(j - 1, -1, -1):  # the group order[i:j]
            r = order[i]
            length, n_max = max(length, sp[r] + runs[r]), max(n_max, runs[r])
            span = sl[order[j - 1]] - sl[r] + 1
            cost = best[i] + _group_cost(span, length, n_max, j - i)
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i
            if _ALONE_NS + span * length * 63 >= best[j]:
                break  # a wider group can only cost more than the best so far
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _gather_index(cu: list[int], reqs: list[list[int]], groups: tuple[_Padded, ...], alone: tuple[int, ...]) -> Tensor:
    """Flat token -> row of the groups' padded outputs (each group's ``out_index``, offset by the
    groups before it) followed by the lone requests' outputs."""
    index = torch.empty(cu[-1], dtype=torch.long)
    offset = 0
    for rs, p in zip(reqs, groups):
        rows = torch.cat([torch.arange(cu[r], cu[r + 1]) for r in rs])
        index[rows] = offset + p.out_index.cpu()  # a group is never the whole pass: it always has one
        offset += p.span * p.n_max
    for r in alone:
        index[cu[r]:cu[r + 1]] = offset + torch.arange(cu[r + 1] - cu[r])
        offset += cu[r + 1] - cu[r]
    return index


def _plan_padded(cu: list[int], sl: list[int], sp: list[int], device: torch.device, group: int,
                 reqs: range | list[int]) -> _Padded:
    """The padded layout of the requests ``reqs`` (distinct slots, non-empty runs)."""
    reqs = list(reqs)
    runs = {r: cu[r + 1] - cu[r] for r in reqs}
    n_max, length = max(runs.values()), max(sp[r] + runs[r] for r in reqs)
    base = min(sl[r] for r in reqs)
    span = max(sl[r] for r in reqs) - base + 1
    # Row p of the padded batch is slot base + p.  Query i < n_r of request r sits at position
    # sp[r] + i and sees keys 0..sp[r]+i.  Padding queries (i >= n_r, or slots of the span that
    # are not in this group) repeat a real query with a non-empty mask; their outputs are dropped.
    row_of_slot = {sl[r] - base: r for r in reqs}
    # q and the output need no gather when the group is the whole pass in slot order, runs equal
    aligned = (len(reqs) == len(sl) and span == len(reqs) and all(row_of_slot[p] == p for p in range(span))
               and min(runs.values()) == n_max)
    # Built as Python lists and made tensors once: a tensor write per request cost more than the
    # attention itself on the conformance suite's tiny targets (py-spy, R = 256).
    last_of, n_of, first_of = [0] * span, [1] * span, [cu[reqs[0]]] * span
    for p, r in row_of_slot.items():
        last_of[p], n_of[p], first_of[p] = sp[r], runs[r], cu[r]
    last = torch.tensor(last_of, dtype=torch.long)  # last visible key of padded query 0, per row
    n_of_row = torch.tensor(n_of, dtype=torch.long)
    i = torch.arange(n_max)
    # query i of row p sees keys 0..last[p] + min(i, n_p - 1)
    limit = last[:, None] + torch.minimum(i[None, :], n_of_row[:, None] - 1)  # [P, n_max]
    mask = torch.arange(length)[None, None, :] <= limit[:, :, None]  # [P, n_max, L]
    q_index = out_index = None
    if not aligned:
        first = torch.tensor(first_of, dtype=torch.long)
        q_index = (first[:, None] + torch.minimum(i[None, :], n_of_row[:, None] - 1)).reshape(-1)
        out_index = torch.tensor([(sl[r] - base) * n_max + j for r in reqs for j in range(runs[r])], dtype=torch.long)
        q_index, out_index = q_index.to(device), out_index.to(device)
    merged = n_max > 1 and group > 1  # a single query per row gains nothing from merging (measured)
    if merged:
        mask = mask.repeat(1, group, 1)  # row g·n + i has query i's mask
    return _Padded(base, span, n_max, length, q_index, out_index, mask[:, None].to(device), merged)


def varlen_attention_planned(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: VarlenPlan, scale: float) -> Tensor:
    """:func:`varlen_attention_reference` for a pass planned by :func:`plan_varlen_attention`.

    ``q``/``k_cache``/``v_cache`` must be those the plan was made for (one layer's cache of the
    shape it was checked against); nothing is re-checked here, that is the point of a plan.
    """
    if plan.padded is not None:
        return _attend_padded(q, k_cache, v_cache, plan.padded, scale, gather=True)
    if not plan.groups:
        return attend_per_request(q, k_cache, v_cache, plan.cu, plan.slots, plan.start, scale, plan.tree)
    parts = [_attend_padded(q, k_cache, v_cache, p, scale, gather=False) for p in plan.groups]
    cu, sl, sp = plan.cu, plan.slots, plan.start
    for r in plan.alone:
        parts.append(attend_per_request(q[cu[r]:cu[r + 1]], k_cache, v_cache, [0, cu[r + 1] - cu[r]], [sl[r]],
                                         [sp[r]], scale))
    return torch.cat(parts)[plan.gather]


def _attend_padded(q: Tensor, k_cache: Tensor, v_cache: Tensor, p: _Padded, scale: float, gather: bool) -> Tensor:
    """One padded SDPA: ``[P·n_max, Hq, D]``, or with ``gather`` the requests' tokens in flat order."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    group = hq // hkv
    k = k_cache[p.base : p.base + p.span, :, : p.length]  # [P, Hkv, L, D] views, never copied
    v = v_cache[p.base : p.base + p.span, :, : p.length]
    qp = q if p.q_index is None else q[p.q_index]
    if p.merged:
        # The G query heads that share a kv head become G·n query rows of that head: the CPU
        # flash kernel then runs Hkv head programs of G·n rows instead of Hq of n rows, ~2x
        # faster for verify runs.  Head h reads kv head h // G, so row g·n + i is head kv·G + g.
        qp = qp.view(p.span, p.n_max, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(p.span, hkv, group * p.n_max, d)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale)  # [P, Hkv, G·n, D]
        o = o.view(p.span, hkv, group, p.n_max, d).permute(0, 3, 1, 2, 4).reshape(p.span * p.n_max, hq, d)
    else:
        qp = qp.view(p.span, p.n_max, hq, d).transpose(1, 2)  # [P, Hq, n_max, D]
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale, enable_gqa=bool(group != 1))
        o = o.transpose(1, 2).reshape(p.span * p.n_max, hq, d)
    return o if p.out_index is None or not gather else o[p.out_index]
