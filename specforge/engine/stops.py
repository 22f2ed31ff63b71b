"""Stop conditions applied to the tokens a round commits, also inside an accepted block.

Why cutting there keeps the output exact: docs/design/round.md#commit-truncation-and-rollback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specforge.engine.request import FinishReason

__all__ = ["apply_token_stops", "find_stop_string", "stop_prefix_length"]


def apply_token_stops(
    tokens: Sequence[int], eos_ids: frozenset[int], remaining: int, room: int
) -> tuple[list[int], str | None]:
    """Cut a round's committed tokens at the first EOS (kept, as Hugging Face does), at the
    ``remaining`` max-new-token budget, or at the context ``room``; return the kept tokens and
    why the request finished (``None`` if it goes on)."""
    kept: list[int] = []
    for token in tokens:
        if len(kept) == remaining:
            return kept, FinishReason.LENGTH
        if len(kept) == room:
            return kept, FinishReason.CONTEXT
        kept.append(token)
        if token in eos_ids:
            return kept, FinishReason.EOS
    if len(kept) == remaining:
        return kept, FinishReason.LENGTH
    if len(kept) == room:
        return kept, FinishReason.CONTEXT
    return kept, None


def find_stop_string(
    tokens: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str], start: int
) -> tuple[int, int] | None:
    """Locate the earliest stop string that ends in tokens ``start:`` of the output.

    Returns ``(tokens_to_keep, text_length_to_keep)``: the output keeps the tokens up to the one
    that completes the stop string and the text before the stop string, or ``None``.
    """
    if not stops:
        return None
    text = decode(tokens)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return None
    cut, stop = min(hits)
    end = cut + len(stop)
    # The fewest tokens whose text already contains the whole stop string.
    for n in range(max(start, 1), len(tokens) + 1):
        if len(decode(tokens[:n])) >= end and stop in decode(tokens[:n]):
            return n, cut
    return len(tokens), cut


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins a stop string without completing it.

    A stream holds that much back: the next round may complete the stop string, and the output
    then ends before it, so text already sent would have to be taken back."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
