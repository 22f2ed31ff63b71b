"""Chat conversations, and their tokenisation with a loss mask over the assistant's tokens.

A drafter learns to predict what the *target* writes, so only the assistant replies (and the
end-of-turn token that closes each of them, which the target also emits) carry loss; system
prompts, user turns and the template's role headers are context.

The mask is not found by searching the rendered text for the reply (a reply that repeats a user
sentence, or a template that rewrites content, would fool a search).  Instead the conversation is
rendered by the tokenizer's own chat template prefix by prefix: ``messages[:i]`` with the
generation prompt marks where reply ``i`` starts, ``messages[:i+1]`` where it ends.  The full text
is then tokenised once and each token is assigned to the span it falls in, so a merge of characters
across a span boundary cannot shift the mask.  A reply that carries the ids the target wrote
(:data:`WRITTEN_IDS`) keeps them: text → tokens is not the inverse of tokens → text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from specforge.errors import SpecforgeError

__all__ = [
    "ChatTemplateError",
    "Conversation",
    "TokenizedChat",
    "WRITTEN_IDS",
    "assistant_spans",
    "normalize_message",
    "reply_spans",
    "tokenize_conversation",
]

#: The key of an assistant message that holds the token ids the target wrote for it (regeneration
#: keeps them): tokenisation splices them in instead of tokenising the reply's text again.
WRITTEN_IDS = "token_ids"

# ShareGPT and similar dumps name the speakers differently; everything maps onto the three roles a
# chat template understands.  "chatgpt", "bing" and "bard" are the assistant in ShareGPT exports of
# other chat front-ends.
_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


class ChatTemplateError(SpecforgeError, ValueError):
    """The tokenizer's chat template cannot give an exact assistant mask for this conversation."""


def normalize_message(message: Mapping[str, Any]) -> dict[str, str]:
    """``{"role", "content"}`` from a chat message or a ShareGPT ``{"from", "value"}`` turn.

    Raises ValueError naming the problem (unknown role, missing or non-string content), which the
    loaders count as the reason a record was skipped.
    """
    if not isinstance(message, Mapping):
        raise ValueError(f"message is a {type(message).__name__}, not an object")
    raw_role = message.get("role", message.get("from"))
    content = message.get("content", message.get("value"))
    if not isinstance(raw_role, str):
        raise ValueError("message without a role")
    role = _ROLE_ALIASES.get(raw_role.strip().lower())
    if role is None:
        raise ValueError(f"unknown role {raw_role!r}")
    if not isinstance(content, str):
        raise ValueError(f"{role} message without string content")
    return {"role": role, "content": content}


@dataclass
class Conversation:
    """One conversation: a stable id (for order-stable, resumable processing) and its messages."""

    id: str
    messages: list[dict[str, str]] = field(default_factory=list)

    @property
    def user_turns(self) -> list[str]:
        """The user messages' contents: the prompts a target regenerates answers to."""
        return [m["content"] for m in self.messages if m["role"] == "user"]

    @property
    def has_user_turn(self) -> bool:
        """Whether there is a prompt to answer (a non-blank user message); loaders require one."""
        return any(m["role"] == "user" and m["content"].strip() for m in self.messages)


@dataclass
class TokenizedChat:
    """Token ids and the 0/1 loss mask (1 on assistant tokens), both 1-D ``torch.long`` tensors."""

    input_ids: Any
    loss_mask: Any
    truncated: bool  # True when the rendered conversation was longer than ``max_length``

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant replies
    (:func:`reply_spans` without the message indices)."""
    text, spans = reply_spans(tokenizer, messages)
    return text, [(start, end) for _, start, end in spans]


def reply_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int, int]]]:
    """The rendered conversation and, per assistant reply, ``(message index, start, end)``: the
    character span ``[start, end)`` of the reply.

    A span starts where the template's generation prompt for that reply ends and stops after the
    reply's end-of-turn marker; trailing whitespace the template adds between turns is left out,
    because the target stops at the end-of-turn token and never generates it.  An assistant
    message that opens the conversation gets no span: it answers no prompt.
    """
    text = _render(tokenizer, messages, generation_prompt=False)
    spans: list[tuple[int, int, int]] = []
    for i, message in enumerate(messages):
        # A reply that opens the conversation answers no prompt: the target never writes one, and
        # templates disagree on what precedes it (some refuse an empty prefix, some insert a
        # default system prompt only before a first message), so it stays context.
        if message["role"] != "assistant" or i == 0:
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        # A template that renders earlier turns differently once later turns exist (some strip
        # reasoning from past replies) has no stable prefix: no exact mask can be read off it.
        for prefix in (before, through):
            if not text.startswith(prefix):
                raise ChatTemplateError(
                    f"the chat template renders message {i} differently once later messages follow; "
                    "the assistant mask cannot be derived from prefixes"
                )
        if len(before) > len(through):
            raise ChatTemplateError(f"the generation prompt for message {i} is not a prefix of its reply")
        end = len(through.rstrip())
        if end > len(before):
            spans.append((i, len(before), end))
    return text, spans


def _token_boundaries(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` (no extra special tokens: the template writes its own) and char offsets."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: Iterable[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    spans = list(spans)
    for t, (lo, hi) in enumerate(offsets):
        if hi == lo:
            continue  # a token with no characters (none in practice) carries no reply text
        # A token belongs to a reply when it overlaps its span: a token merged across the
        # header/reply boundary still carries the reply's first characters.
        if any(lo < end and hi > start for start, end in spans):
            mask[t] = 1
    return mask


def _splice_written(tokenizer: Any, text: str, spans: list[tuple[int, int, int]], messages: list[dict[str, str]],
                    written: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """Ids and assistant mask of the rendered ``text``; a reply whose message carries the ids the
    target wrote (:data:`WRITTEN_IDS`, kept by regeneration) keeps those ids instead of the text's
    tokenisation.

    Decoding and tokenising again is not the identity for a byte-pair tokenizer: SmolLM2 writes a
    paragraph break as one token ("\\n\\n") where its tokenizer, given the text, makes two.  A
    drafter trained on the text's tokens would learn tokens the target never writes at exactly
    those places.  The text is tokenised piece by piece between the spliced replies: the piece
    before a reply is the generation prompt the target answered, tokenised as it was.  A reply
    the template rendered differently from its content (stripped, say) keeps the text's tokens.
    """
    pieces: list[tuple[int, int, list[int] | None]] = []  # (start, end, ids or None: tokenise the text)
    at = 0
    for i, start, _ in spans:
        content = messages[i]["content"]
        if i in written and text.startswith(content, start):
            pieces += [(at, start, None), (start, start + len(content), written[i])]
            at = start + len(content)
    pieces.append((at, len(text), None))
    ids: list[int] = []
    mask: list[int] = []
    for lo, hi, kept in pieces:
        if kept is not None:
            ids += kept
            mask += [1] * len(kept)
        elif hi > lo:
            piece, offsets = _token_boundaries(tokenizer, text[lo:hi])
            ids += piece
            mask += _mask_from_offsets([(a + lo, b + lo) for a, b in offsets], [(s, e) for _, s, e in spans])
    return ids, mask


def _mask_from_prefix_ids(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Fallback for tokenizers without offsets: tokenise each span boundary's prefix separately.

    Exact only when tokenising a prefix gives a prefix of the full ids; when it does not, the
    boundary is ambiguous and a :class:`ChatTemplateError` says so instead of guessing.
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    mask = [0] * len(ids)
    for start, end in spans:
        bounds = []
        for cut in (start, end):
            head = list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
            if ids[: len(head)] != head:
                raise ChatTemplateError(
                    "the tokenizer has no offset mapping and merges tokens across a turn boundary"
                )
            bounds.append(len(head))
        for t in range(bounds[0], bounds[1]):
            mask[t] = 1
    return ids, mask


def tokenize_conversation(
    tokenizer: Any,
    conversation: Conversation | list[dict[str, str]],
    max_length: int | None = None,
) -> TokenizedChat:
    """Render ``conversation`` with ``tokenizer``'s chat template; ids plus the assistant loss mask.

    ``max_length`` keeps the first ``max_length`` tokens (the start of a conversation is the
    context every later reply needs).  A conversation without assistant replies gets an all-zero
    mask: it is context only, which the caller may drop.
    """
    import torch

    raw = conversation.messages if isinstance(conversation, Conversation) else conversation
    messages = [normalize_message(m) for m in raw]
    if not messages:
        raise ValueError("an empty conversation has nothing to tokenise")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatTemplateError("the tokenizer has no chat template")
    text, spans = reply_spans(tokenizer, messages)
    written = {i: list(m[WRITTEN_IDS]) for i, m in enumerate(raw) if isinstance(m, Mapping) and m.get(WRITTEN_IDS)}
    if getattr(tokenizer, "is_fast", False):
        ids, mask = _splice_written(tokenizer, text, spans, messages, written)
    else:
        ids, mask = _mask_from_prefix_ids(tokenizer, text, [(lo, hi) for _, lo, hi in spans])
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedChat(
        input_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.long),
        truncated=truncated,
    )


def take(stream, limit: int | None) -> list[Conversation]:
    """The first ``limit`` items of a loader's stream (all when ``None``), then close it.

    The limit is checked before the next record is read, so the loader's report counts only
    what was kept.
    """
    out: list[Conversation] = []
    try:
        while limit is None or len(out) < limit:
            item = next(stream, None)
            if item is None:
                break
            out.append(item)
    finally:
        stream.close()
    return out
