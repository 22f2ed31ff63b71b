"""Causal attention over a flattened variable-length batch, reading K/V from a slotted cache.

All new tokens of all requests form one token dimension ``N`` (no padding).  Request ``r`` owns
rows ``cu_seqlens[r]:cu_seqlens[r+1]`` of ``q`` (``[N, Hq, D]``), which sit at absolute positions
``start_pos[r] + i``; its keys and values are ``k_cache[slots[r], :, :start_pos[r] + n_r]`` of
``k_cache, v_cache: [S, Hkv, T, D]`` (the new tokens' K/V are already written there).  The token
at position ``p`` attends keys ``0..p`` of its own slot; query head ``h`` reads kv head
``h // (Hq // Hkv)`` (GQA).  A *tree* pass (a token tree verified at once) replaces the causal
rule inside each run: ``tree[i]`` is a bitmask over the run's own tokens and token i sees bit j's
token iff it is set (its ancestors and itself), and every key before the run.  Nothing past a
request's last written position is ever attended to,
so the rest of a slot may hold anything (stale entries after a rollback, another request's
leftovers) — finite values only for the padded path of :func:`varlen_attention_planned`, which
reads them under a mask.

Three implementations compute this same function:

* :func:`varlen_attention_reference` — pure torch, one SDPA call per request on views of the
  cache.  It is the oracle of the Triton kernel.
* :func:`varlen_attention_planned` — the production CPU path: the same per-request calls with the
  metadata checked once per pass (:func:`plan_varlen_attention`), or, for short runs, padded
  masked SDPAs over groups of neighbouring cache slots of similar lengths.
* :func:`varlen_attention_triton` — a flash-attention style Triton kernel (online softmax,
  float32 accumulation) for CUDA devices; on a CPU it runs only under ``TRITON_INTERPRET=1``.

:func:`varlen_attention` picks the reference or the kernel; the runtime calls the planned path on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twin must keep working where Triton is not installed
    triton = None
    tl = None

__all__ = [
    "VarlenPlan",
    "plan_varlen_attention",
    "tree_mask",
    "varlen_attention",
    "varlen_attention_planned",
    "varlen_attention_reference",
    "varlen_attention_triton",
]

Backend = Literal["auto", "torch", "triton"]


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
) -> tuple[list[int], list[int], list[int]]:
    """Validate the call and return the launch metadata as host lists ``(cu, slots, start)``.

    The metadata is copied to the host once, in one transfer, because both implementations need
    it there anyway (the torch twin to slice per request, the kernel to size its grid).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [S, Hkv, T, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}"
        )
    n_tokens, hq, d = q.shape
    n_slots, hkv, capacity, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dim of q ({d}) and of the cache ({dk}) differ")
    if d == 0:
        raise ValueError("head dim must be positive")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError("q, k_cache and v_cache must be on the same device")
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots), ("start_pos", start_pos)):
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    n_req = cu_seqlens.shape[0] - 1
    if n_req < 0:
        raise ValueError("cu_seqlens must hold at least one entry (R + 1 boundaries)")
    if slots.shape[0] != n_req or start_pos.shape[0] != n_req:
        raise ValueError(
            f"cu_seqlens describes {n_req} requests but slots has {slots.shape[0]} and "
            f"start_pos {start_pos.shape[0]} entries"
        )

    return _host_meta(n_tokens, n_slots, capacity, cu_seqlens, slots, start_pos)


def _host_meta(
    n_tokens: int, n_slots: int, capacity: int, cu_seqlens: Tensor, slots: Tensor, start_pos: Tensor
) -> tuple[list[int], list[int], list[int]]:
    """Copy the metadata to the host in one transfer and check it against the cache's shape."""
    n_req = cu_seqlens.shape[0] - 1
    parts = [cu_seqlens.long(), slots.long(), start_pos.long()]
    if cu_seqlens.device == slots.device == start_pos.device:
        meta = torch.cat(parts).tolist()  # one device-to-host transfer, not three
    else:
        meta = [x for t in parts for x in t.tolist()]
    cu, sl, sp = meta[: n_req + 1], meta[n_req + 1 : 2 * n_req + 1], meta[2 * n_req + 1 :]
    if cu[0] != 0 or cu[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to N={n_tokens}, got {cu[0]}..{cu[-1]}")
    for r in range(n_req):
        n = cu[r + 1] - cu[r]
        if n < 0:
            raise ValueError(f"cu_seqlens must be non-decreasing (request {r}: {cu[r]} -> {cu[r + 1]})")
        if not 0 <= sl[r] < n_slots:
            raise ValueError(f"request {r}: slot {sl[r]} outside the cache's {n_slots} slots")
        if sp[r] < 0:
            raise ValueError(f"request {r}: negative start position {sp[r]}")
        if sp[r] + n > capacity:
            raise ValueError(
                f"request {r}: positions {sp[r]}..{sp[r] + n - 1} exceed the cache capacity T={capacity}"
            )
    return cu, sl, sp


# --------------------------------------------------------------------------------------------
# the torch twin
# --------------------------------------------------------------------------------------------


def varlen_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    """Pure-torch varlen causal attention: ``[N, Hq, D]`` in ``q``'s dtype.

    One ``scaled_dot_product_attention`` per request on 4-D views of its slot — the cache is
    never copied.  4-D matters: torch's CPU flash kernel takes only 4-D inputs (3-D ones fall
    back to the unfused math path, measured ~2x slower on these shapes), and with
    ``enable_gqa`` it maps query heads to kv heads itself, without expanding K/V (the math path
    would repeat them).  A single-token run attends every key of
    its slice, so it needs no mask at all.
    """
    cu, sl, sp = _check(q, k_cache, v_cache, cu_seqlens, slots, start_pos)
    return _attend_per_request(q, k_cache, v_cache, cu, sl, sp, scale, _tree_bits(tree, q.shape[0]))


def _tree_bits(tree: Tensor | None, n_tokens: int) -> Tensor | None:
    if tree is None:
        return None
    if tree.shape != (n_tokens,) or tree.dtype != torch.int64:
        raise ValueError(f"tree must be [N={n_tokens}] int64 bitmasks, got {tuple(tree.shape)} {tree.dtype}")
    return tree


def tree_mask(bits: Tensor, n: int, start: int) -> Tensor:
    """``[n, start + n]`` bool: every key before the run, then run token j where bit j is set."""
    own = ((bits[:, None] >> torch.arange(n, device=bits.device)[None, :]) & 1).bool()
    return torch.cat([own.new_ones(n, start), own], 1)


def _attend_per_request(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu: list[int], sl: list[int], sp: list[int], scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    n_tokens, hq, d = q.shape
    gqa = bool(hq != k_cache.shape[1])  # a plain bool also under torch.compile's symbolic shapes
    out = torch.empty((n_tokens, hq, d), dtype=q.dtype, device=q.device)
    for r in range(len(sl)):
        a, b = cu[r], cu[r + 1]
        n = b - a
        if n == 0:
            continue
        length = sp[r] + n  # keys 0..length-1 are this request's
        # [1, Hkv, L, D] views; a slice rather than an index keeps the slot symbolic under
        # torch.compile (an index would be specialised: one graph per slot)
        k = k_cache[sl[r] : sl[r] + 1, :, :length]
        v = v_cache[sl[r] : sl[r] + 1, :, :length]
        qr = q[a:b].transpose(0, 1)[None]  # [1, Hq, n, D]
        if tree is not None and n > 1:  # a token tree: each node sees its ancestors (and the prefix)
            mask = tree_mask(tree[a:b].to(q.device), n, sp[r])
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        elif n == 1:
            o = F.scaled_dot_product_attention(qr, k, v, scale=scale, enable_gqa=gqa)
        elif length == n:
            # A prefill from position 0: SDPA's top-left aligned causal mask is exactly ours,
            # and is_causal lets the flash kernel skip the masked blocks without building a mask.
            o = F.scaled_dot_product_attention(qr, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # is_causal would align the diagonal top-left (query i sees keys 0..i), but behind a
            # cached prefix query i must see keys 0..start+i: an explicit mask it is.
            mask = _causal_mask(n, length, q.device)
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[a:b] = o[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------------------------
# planned attention: metadata checked once per pass, many short runs in one padded SDPA
# --------------------------------------------------------------------------------------------


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
    CPUs, see ``specforge.target.kv_dtype``) passes ``exact=False``: no parity is at stake, and
    grouping pays there too.  ``True`` forces one padded SDPA for the whole pass, ``False`` the
    per-request path (batch-invariant).

    The padded path reads keys past a request's own length (masked).  A NaN or inf there would
    poison the row (0 × NaN), so it needs the slot's stale entries to be finite; the runtime's
    :class:`~specforge.target.cache.KVCache` clears what a request wrote when its slot is freed.
    """
    n_slots, hkv, capacity, _ = k_cache.shape
    group = max(1, q_heads // hkv)
    cu, sl, sp = _host_meta(n_tokens, n_slots, capacity, cu_seqlens, slots, start_pos)
    if tree is not None:  # tree passes are rare (tree drafters only): the per-request masked path
        return VarlenPlan(cu, sl, sp, None, _tree_bits(tree, n_tokens))
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
    last = torch.zeros(span, dtype=torch.long)  # last visible key of padded query 0, per row
    n_of_row = torch.ones(span, dtype=torch.long)
    for p, r in row_of_slot.items():
        last[p], n_of_row[p] = sp[r], runs[r]
    i = torch.arange(n_max)
    # query i of row p sees keys 0..last[p] + min(i, n_p - 1)
    limit = last[:, None] + torch.minimum(i[None, :], n_of_row[:, None] - 1)  # [P, n_max]
    mask = torch.arange(length)[None, None, :] <= limit[:, :, None]  # [P, n_max, L]
    q_index = out_index = None
    if not aligned:
        first = torch.full((span,), cu[reqs[0]], dtype=torch.long)
        for p, r in row_of_slot.items():
            first[p] = cu[r]
        q_index = (first[:, None] + torch.minimum(i[None, :], n_of_row[:, None] - 1)).reshape(-1)
        out_index = torch.cat([torch.arange(runs[r]) + (sl[r] - base) * n_max for r in reqs])
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
        return _attend_per_request(q, k_cache, v_cache, plan.cu, plan.slots, plan.start, scale, plan.tree)
    parts = [_attend_padded(q, k_cache, v_cache, p, scale, gather=False) for p in plan.groups]
    cu, sl, sp = plan.cu, plan.slots, plan.start
    for r in plan.alone:
        parts.append(_attend_per_request(q[cu[r]:cu[r + 1]], k_cache, v_cache, [0, cu[r + 1] - cu[r]], [sl[r]],
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


def _causal_mask(n: int, length: int, device: torch.device) -> Tensor:
    """``[n, length]`` bool, True where query ``i`` (at position ``length - n + i``) may look."""
    start = length - n
    keys = torch.arange(length, device=device)
    queries = torch.arange(start, length, device=device)
    return keys[None, :] <= queries[:, None]


# --------------------------------------------------------------------------------------------
# the Triton kernel
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _varlen_attn_fwd(
        Q, K, V, O, CU, SLOTS, START, TREE,
        qk_scale,  # softmax scale * log2(e): the kernel exponentiates in base 2
        stride_qn, stride_qh, stride_qd,
        stride_ks, stride_kh, stride_kt, stride_kd,
        stride_vs, stride_vh, stride_vt, stride_vd,
        stride_on, stride_oh, stride_od,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        HAS_TREE: tl.constexpr,
    ):
        req = tl.program_id(0)
        m_block = tl.program_id(1)
        head = tl.program_id(2)

        # int64 throughout the address arithmetic: slot * stride_ks overflows int32 for large
        # caches (64 slots x 8 heads x 32k positions x 128 dims is 2^31 elements per layer).
        row0 = tl.load(CU + req).to(tl.int64)
        n = tl.load(CU + req + 1).to(tl.int64) - row0
        m_start = m_block * BLOCK_M
        # The grid is sized for the longest run; shorter runs leave their tail programs idle.
        if m_start >= n:
            return
        slot = tl.load(SLOTS + req).to(tl.int64)
        start = tl.load(START + req).to(tl.int64)

        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < n
        d_ok = offs_d < HEAD_DIM  # BLOCK_D pads a head dim that is not a power of two

        q_ptrs = Q + (row0 + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            q = q.to(tl.float32)

        kv_head = head // GROUP
        k_base = K + slot * stride_ks + kv_head * stride_kh
        v_base = V + slot * stride_vs + kv_head * stride_vh
        q_pos = start + offs_m
        # Keys beyond the last query of this block are masked for every row: stop there.  The
        # bound never passes start + n, so nothing beyond the request's written positions is
        # loaded (masked loads give 0, which cannot turn into NaN the way garbage would).
        kv_end = start + tl.minimum(n, m_start + BLOCK_M)
        if HAS_TREE:
            # a node's ancestors precede it in the run, so the causal bound above still holds;
            # padding rows read all bits set (they see every key, like the causal padding rows)
            bits = tl.load(TREE + row0 + offs_m, mask=m_ok, other=-1)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            kt = tl.load(
                k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N], K transposed
            if DOT_IN_FP32:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
            # Padding rows (offs_m >= n) sit past every key and so see all of them: no row is
            # ever fully masked, and key 0 in the first block keeps m_i finite from then on.
            if HAS_TREE:
                rel = tl.maximum(offs_n - start, 0).to(tl.int64)
                own = ((bits[:, None] >> rel[None, :]) & 1) == 1
                visible = (offs_n[None, :] < start) | own
            else:
                visible = offs_n[None, :] <= q_pos[:, None]
            s = tl.where(visible & n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
            if DOT_IN_FP32:
                v = v.to(tl.float32)
            # p is rounded to the K/V dtype for the tensor-core dot, as flash-attention does.
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        o_ptrs = O + (row0 + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    # triton.jit decides at decoration time whether this is a compiled or an interpreted
    # function (TRITON_INTERPRET read when this module is imported); record which it became.
    _KERNEL_INTERPRETED = type(_varlen_attn_fwd).__name__ == "InterpretedFunction"
else:
    _KERNEL_INTERPRETED = False

_LOG2E = 1.4426950408889634


def _launch_meta(dtype: torch.dtype, head_dim: int, group: int, max_n: int, interpreted: bool) -> dict:
    """Compile-time parameters and ``num_warps`` of one launch (shared with the compile test)."""
    # 16 is tl.dot's smallest tile; decode/verify runs (1..16 tokens) fit one block, prefill
    # gets the usual 64 x 64 flash tiles.
    block_m = 16 if max_n <= 16 else (32 if max_n <= 32 else 64)
    # Triton's interpreter multiplies the raw uint16 bit patterns in a bfloat16 tl.dot
    # (triton-lang/triton#11584, unsupported upstream): there the operands are upcast first.
    # Compiled kernels keep bfloat16 tensor-core dots.
    dot_in_fp32 = interpreted and dtype == torch.bfloat16
    fp32 = dtype == torch.float32
    block_d = max(16, 1 << (head_dim - 1).bit_length())  # dot tiles need a power of two >= 16
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        # float32 tiles take twice the shared memory of half ones, and the default 3-stage
        # pipeline of K/V loads would need up to 205 KB for big heads (over sm_80's 163 KB);
        # smaller key blocks and 2 stages keep every head dim <= 256 within it.
        BLOCK_N=32 if (fp32 and block_d > 64) or block_d > 128 else 64,
        BLOCK_D=block_d,
        # float32 inputs get IEEE dots: TF32 would cost ~1e-3 relative error against the twin.
        DOT_PRECISION="ieee" if fp32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        num_warps=4,
        num_stages=2 if fp32 else 3,
    )


def _require_runnable_kernel(q: Tensor) -> None:
    if triton is None:
        raise RuntimeError("varlen_attention_triton needs the `triton` package, which is not installed")
    if not q.is_cuda and not _KERNEL_INTERPRETED:
        raise RuntimeError(
            "varlen_attention_triton runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before specforge_kernels.varlen_attention (and triton) are first imported, or use "
            "backend='torch'"
        )


def varlen_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    tree: Tensor | None = None,
) -> Tensor:
    """Triton varlen causal (or tree) attention; same contract as :func:`varlen_attention_reference`.

    One program per (request, block of ``BLOCK_M`` queries, query head), streaming key blocks of
    the request's slot up to the block's causal limit with an online softmax accumulated in
    float32.  float32 inputs use IEEE-precision dots (no TF32), so the result stays within
    float32 rounding of the twin.  Any head dim works (it is padded to a power of two ≥ 16 and
    masked).  Validation copies the metadata to the host once (one device sync per call).
    """
    _require_runnable_kernel(q)
    for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots), ("start_pos", start_pos)):
        if t.device != q.device:  # the kernel dereferences them as device pointers
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    cu, _, _ = _check(q, k_cache, v_cache, cu_seqlens, slots, start_pos)
    tree = _tree_bits(tree, q.shape[0])
    if tree is not None and tree.device != q.device:
        raise ValueError(f"tree must be on q's device ({q.device}), got {tree.device}")
    n_tokens, hq, d = q.shape
    hkv = k_cache.shape[1]
    out = torch.empty((n_tokens, hq, d), dtype=q.dtype, device=q.device)
    n_req = len(cu) - 1
    max_n = max((cu[r + 1] - cu[r] for r in range(n_req)), default=0)
    if max_n == 0:
        return out

    meta = _launch_meta(q.dtype, d, hq // hkv, max_n, _KERNEL_INTERPRETED)
    grid = (n_req, triton.cdiv(max_n, meta["BLOCK_M"]), hq)
    _varlen_attn_fwd[grid](
        q, k_cache, v_cache, out, cu_seqlens, slots, start_pos, cu_seqlens if tree is None else tree,
        float(scale) * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        HAS_TREE=tree is not None,
        **meta,
    )
    return out


# --------------------------------------------------------------------------------------------
# dispatcher
# --------------------------------------------------------------------------------------------


def varlen_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens: Tensor,
    slots: Tensor,
    start_pos: Tensor,
    scale: float,
    backend: Backend = "auto",
    tree: Tensor | None = None,
) -> Tensor:
    """Varlen causal (or tree) attention over a slotted KV cache (see the module docstring).

    ``backend="auto"`` runs the Triton kernel for CUDA tensors and the torch twin otherwise;
    ``"torch"`` and ``"triton"`` force one.  ``"triton"`` on CPU tensors works only when the
    kernel was built under ``TRITON_INTERPRET=1`` (tests), and says so otherwise.
    """
    if backend == "auto":
        backend = "triton" if q.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return varlen_attention_reference(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale, tree)
    if backend == "triton":
        return varlen_attention_triton(q, k_cache, v_cache, cu_seqlens, slots, start_pos, scale, tree)
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
