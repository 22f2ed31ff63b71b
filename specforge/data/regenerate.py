"""Regenerate the assistant turns of conversations with the target itself (docs/data.md).

A drafter learns to predict what the *target* writes, so the replies in a dataset (ShareGPT's
come from ChatGPT) are replaced by the target's own answers: the user (and system) messages are
kept, and the target answers them turn by turn through the engine — the answer to user turn 1,
then that answer plus user turn 2 as the next prompt, and so on (or the first turn only).

Everything that makes a sample is pinned, so the output is a pure function of the inputs:

- each turn's seed is ``base_seed + H(conversation id) + turn`` (``H`` a stable hash), and the
  engine draws every request's randomness from its own generator, so an answer does not depend on
  its batch-mates, the batch size or the order requests finish in;
- output order is input order: shard ``k`` holds input conversations ``[k·S, (k+1)·S)`` minus
  the skipped ones, written only once all of them are done;
- shards and the manifest are written to a temporary file and renamed, so a killed run leaves
  complete shards or none, and a restart resumes at the first shard the manifest does not list.

A restarted run therefore writes byte for byte what an uninterrupted one would.  The manifest
(``progress.json``) records what the output was made from — source name, count and a hash of the
ids and kept messages; target name and dtype; decoder; sampling — and an output directory made
from anything else is refused before a byte is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.errors import SpecforgeError
from specforge.data.chat import Conversation, normalize_message

__all__ = [
    "MANIFEST",
    "RegenerationError",
    "RegenerationReport",
    "conversation_seed",
    "iter_regenerated",
    "regenerate",
    "split_turns",
    "target_sampling",
    "turn_seed",
]

MANIFEST = "progress.json"
FORMAT = "specforge-regen/1"
_SEED_MOD = 2**63  # torch.Generator.manual_seed takes any non-negative int below 2**64


class RegenerationError(SpecforgeError, ValueError):
    """The output directory cannot be (re)used for these inputs; nothing was written."""


@dataclass
class RegenerationReport:
    """What a :func:`regenerate` call did.  Counts cover the whole output directory (resumed
    shards included); ``new_tokens`` and ``seconds`` only this call's work."""

    out_dir: str
    conversations: int = 0  # input conversations covered by completed shards
    written: int = 0  # output lines (conversations minus skipped)
    new_tokens: int = 0
    seconds: float = 0.0
    shards: int = 0  # completed shards
    resumed_shards: int = 0  # of which were already complete when the call started
    total_shards: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (id, reason): not in the output
    truncated: list[tuple[str, str]] = field(default_factory=list)  # (id, reason): later turns dropped

    @property
    def complete(self) -> bool:
        return self.shards == self.total_shards

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        out = [
            f"{self.out_dir}: {self.shards}/{self.total_shards} shards, {self.conversations:,} conversations "
            f"({self.written:,} written, {len(self.skipped):,} skipped, {len(self.truncated):,} cut short); "
            f"{self.new_tokens:,} new tokens in {self.seconds:.1f} s ({self.tokens_per_second:.1f} tok/s)"
        ]
        for label, items in (("skipped", self.skipped), ("cut short", self.truncated)):
            out += [f"  {label} {cid}: {reason}" for cid, reason in items[:10]]
            if len(items) > 10:
                out.append(f"  ... and {len(items) - 10} more {label}")
        return "\n".join(out)


# -- turns, seeds, sampling ---------------------------------------------------------------------


def split_turns(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, str]], list[int]]:
    """``(kept, cuts)``: the messages without the assistant's, and where the target answers.

    Cut ``i`` is an index into ``kept``: the target's answer ``i`` follows ``kept[:cuts[i]]``.  A
    run of user messages with no reply between them is one turn (answered once, after its last
    message); an assistant message that answers no user message (one opening the conversation,
    or a second in a row) is dropped with the rest.  A conversation that ends on a user message
    gets that message answered too.
    """
    kept: list[dict[str, str]] = []
    cuts: list[int] = []
    for raw in messages:
        m = normalize_message(raw)
        if m["role"] == "assistant":
            if kept and kept[-1]["role"] == "user" and (not cuts or cuts[-1] < len(kept)):
                cuts.append(len(kept))
            continue
        kept.append(m)
    if kept and kept[-1]["role"] == "user" and (not cuts or cuts[-1] < len(kept)):
        cuts.append(len(kept))
    return kept, cuts


def conversation_seed(conversation_id: str, base_seed: int = 0) -> int:
    """``base_seed`` plus a stable hash of the id (Python's ``hash`` of a str changes per process)."""
    h = int.from_bytes(hashlib.sha256(conversation_id.encode("utf-8")).digest()[:8], "big")
    return (base_seed + h) % _SEED_MOD


def turn_seed(conversation_id: str, turn: int, base_seed: int = 0) -> int:
    """The engine seed of answer ``turn`` (0-based) of a conversation."""
    return (conversation_seed(conversation_id, base_seed) + turn) % _SEED_MOD


def target_sampling(target: Any) -> dict[str, float | int]:
    """The target's recommended sampling from its ``generation_config``, else its plain law.

    Only values the checkpoint sets count (``to_diff_dict``): transformers fills unset fields with
    library defaults (greedy, top-k 50) that recommend nothing.  With no recommendation the answer
    is sampled from the target's own distribution (T=1, no truncation), not greedily: greedy
    answers are a narrower distribution than the one the drafter will be asked to match.
    """
    gc = getattr(getattr(target, "hf_model", None), "generation_config", None)
    diff = gc.to_diff_dict() if gc is not None else {}
    temperature = diff.get("temperature")
    out = {
        "temperature": 1.0 if temperature is None else float(temperature),
        "top_k": int(diff.get("top_k") or 0),
        "top_p": float(diff.get("top_p") or 1.0),
    }
    if diff.get("do_sample") is False:  # the checkpoint asks for greedy decoding
        out["temperature"] = 0.0
    return out


# -- output files -------------------------------------------------------------------------------


def _shard_name(index: int) -> str:
    return f"regen-{index:05d}.jsonl"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # a reader (or a restart) sees the old file or the new one, never half


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, sort_keys=False, separators=(",", ":"))


def _fingerprint(conversations: Sequence[Conversation]) -> str:
    """Hash of every id and the messages regeneration keeps, in order (answers do not matter)."""
    h = hashlib.sha256()
    for c in conversations:
        kept, _ = split_turns(c.messages)
        h.update(_dumps([c.id, kept]).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _decoder_name(engine: Any) -> str:
    # Speculative decoding keeps the target's law but not the sample path: another verifier or
    # drafter gives other (equally valid) answers, so a resumed run must decode as the first did.
    # Component settings (γ, thresholds) are not visible here: resume with the same pipeline.
    def name(part: Any) -> str:
        return f"{type(part).__module__}.{type(part).__qualname__}"

    drafter = "plain" if engine.drafter is None else name(engine.drafter)
    return f"{drafter} + {name(engine.verifier)}"


def _check_existing(out_dir: Path, header: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest if ``out_dir`` holds a run of exactly ``header``; raises otherwise."""
    manifest_path = out_dir / MANIFEST
    if not manifest_path.exists():
        strays = sorted(p.name for p in out_dir.glob("regen-*.jsonl")) if out_dir.is_dir() else []
        if strays:
            raise RegenerationError(f"{out_dir} holds {strays[0]} but no {MANIFEST}; not resuming an unknown run")
        return None
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RegenerationError(f"{manifest_path} is unreadable ({exc}); remove the directory to start over") from None
    diffs = [
        f"  {key}: directory has {_dumps(manifest.get(key))}, this run {_dumps(value)}"
        for key, value in header.items()
        if manifest.get(key) != value
    ]
    if diffs:
        raise RegenerationError(
            f"{out_dir} was regenerated from other inputs or settings; use another directory or remove it:\n"
            + "\n".join(diffs)
        )
    for entry in manifest.setdefault("shards", []):
        path = out_dir / entry["file"]
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
            raise RegenerationError(
                f"{path} is missing or changed since it was written; remove the directory to start over"
            )
    return manifest


def iter_regenerated(out_dir: str | os.PathLike) -> Iterator[Conversation]:
    """The regenerated conversations of a complete output directory, in input order."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    if len(manifest["shards"]) != manifest["total_shards"]:
        raise RegenerationError(
            f"{out_dir}: {len(manifest['shards'])} of {manifest['total_shards']} shards done; finish the run first"
        )
    for entry in manifest["shards"]:
        with open(out_dir / entry["file"], encoding="utf-8") as fh:
            for line in fh:
                record = json.loads(line)
                yield Conversation(id=record["id"], messages=record["messages"])


# -- the run ------------------------------------------------------------------------------------


@dataclass
class _Work:
    """One conversation in flight: the messages so far and the turn being answered."""

    index: int
    conversation: Conversation
    kept: list[dict[str, str]]
    cuts: list[int]
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    answered_len: int = 0  # len(messages) before the current turn's user messages
    finish_reasons: list[str] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)


def _make_engine(target: Any, max_batch: int, max_context: int | None) -> Any:
    from specforge.config import EngineConfig
    from specforge.engine import Engine
    from specforge.plugins import get_host

    config = EngineConfig(max_batch=max_batch, **({} if max_context is None else {"max_context": max_context}))
    # Plain decoding: the rejection verifier with no drafts samples the target's law exactly.
    return Engine(target, get_host().create_verifier("rejection"), engine=config)


def regenerate(
    conversations: Iterable[Conversation],
    target_or_engine: Any,
    out_dir: str | os.PathLike,
    *,
    source: str = "conversations",
    turns: str = "all",
    max_new_tokens: int = 512,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    shard_size: int = 256,
    max_batch: int = 16,
    max_context: int | None = None,
    max_shards: int | None = None,
    progress: bool = True,
) -> RegenerationReport:
    """Answer every conversation's user turns with the target; write JSONL shards to ``out_dir``.

    ``target_or_engine`` is a :class:`~specforge.target.TargetModel` (decoded plainly by an engine
    of ``max_batch`` slots and ``max_context`` tokens) or a ready :class:`~specforge.engine.Engine`
    (its own batch size, context limit and drafter).  ``temperature``/``top_k``/``top_p`` left
    ``None`` take :func:`target_sampling`.  ``turns`` is ``"all"`` or ``"first"`` (answer only
    the first user turn, drop the later ones).  ``source`` names the inputs in the manifest.
    ``max_shards`` stops after that many shards are written by this call (a budget; a later
    call resumes).  A conversation whose first prompt does not fit the context limit is skipped;
    one whose later prompt does not fit keeps the turns answered so far; both are reported.
    """
    if turns not in ("all", "first"):
        raise ValueError(f"turns must be 'all' or 'first', got {turns!r}")
    if shard_size < 1 or max_new_tokens < 1:
        raise ValueError("shard_size and max_new_tokens must be at least 1")
    conversations = list(conversations)
    engine = target_or_engine if hasattr(target_or_engine, "step") else _make_engine(
        target_or_engine, max_batch, max_context)
    if engine.busy:
        raise ValueError("the engine has requests of its own in flight; regenerate needs it to itself")
    target = engine.target
    recommended = target_sampling(target)
    sampling = {
        "temperature": recommended["temperature"] if temperature is None else float(temperature),
        "top_k": recommended["top_k"] if top_k is None else int(top_k),
        "top_p": recommended["top_p"] if top_p is None else float(top_p),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "turns": turns,
    }
    total_shards = -(-len(conversations) // shard_size)
    header = {
        "format": FORMAT,
        "source": {"name": source, "count": len(conversations), "sha256": _fingerprint(conversations)},
        "target": {"name": str(target.name), "dtype": str(target.dtype).removeprefix("torch.")},
        "decoder": _decoder_name(engine),
        "context_limit": int(engine.context_limit),
        "sampling": sampling,
        "shard_size": shard_size,
        "total_shards": total_shards,
    }
    out_dir = Path(out_dir)
    manifest = _check_existing(out_dir, header)  # every refusal happens before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    if manifest is None:
        manifest = {**header, "shards": []}
        _write_atomic(out_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))

    report = RegenerationReport(out_dir=str(out_dir), total_shards=total_shards,
                                resumed_shards=len(manifest["shards"]))

    def account(entry: dict[str, Any]) -> None:
        report.shards += 1
        report.conversations += entry["count"]
        report.written += entry["written"]
        report.skipped += [(s["id"], s["reason"]) for s in entry["skipped"]]
        report.truncated += [(s["id"], s["reason"]) for s in entry["truncated"]]

    for entry in manifest["shards"]:
        account(entry)
    first_shard = len(manifest["shards"])
    last_shard = total_shards if max_shards is None else min(total_shards, first_shard + max_shards)
    end = min(len(conversations), last_shard * shard_size)

    from tqdm.auto import tqdm

    from specforge.engine import FinishReason, GenerationRequest

    bar = tqdm(total=len(conversations), initial=min(len(conversations), first_shard * shard_size),
               unit="conv", desc="regenerate", disable=not progress, dynamic_ncols=True)
    started = time.perf_counter()
    # index -> ("ok", line) | ("skip", reason): finished conversations waiting for their shard.
    done: dict[int, tuple[str, Any]] = {}
    in_flight: dict[int, _Work] = {}  # request id -> its conversation
    next_index = first_shard * shard_size
    next_shard = first_shard
    # Two requests per slot keep the engine full while finished ones are being replaced, without
    # running so far ahead that the shard being written waits on a long queue.
    window = 2 * engine.config.max_batch
    gen = {k: sampling[k] for k in ("temperature", "top_k", "top_p")}

    def finish(work: _Work, skip: str | None = None, cut: str | None = None) -> None:
        bar.update(1)
        if skip is not None:
            done[work.index] = ("skip", skip)
            return
        line = {"id": work.conversation.id, "messages": work.messages,
                "meta": {"finish_reasons": work.finish_reasons, "new_tokens": work.new_tokens}}
        done[work.index] = ("ok", (line, cut))

    def cut_short(work: _Work, reason: str) -> None:
        if work.turn == 0:
            finish(work, skip=reason)
        else:  # keep the answered turns; the user messages of the unanswered one go
            del work.messages[work.answered_len:]
            finish(work, cut=f"turn {work.turn + 1}: {reason}")

    def ask(work: _Work) -> None:
        """Submit the prompt of ``work.turn``, or finish the conversation when it cannot be asked."""
        work.answered_len = len(work.messages)
        lo = work.cuts[work.turn - 1] if work.turn else 0
        work.messages.extend(work.kept[lo : work.cuts[work.turn]])
        try:
            ids = target.encode(work.messages, chat=True)
        except Exception as exc:  # a template that rejects this conversation: its problem only
            return cut_short(work, f"the chat template fails: {exc}")
        if len(ids) >= engine.context_limit:
            return cut_short(work, f"prompt of {len(ids)} tokens does not fit the context limit of "
                                   f"{engine.context_limit}")
        rid = engine.submit(GenerationRequest(
            prompt_ids=ids, max_new_tokens=max_new_tokens, seed=turn_seed(work.conversation.id, work.turn, seed),
            **gen))
        in_flight[rid] = work

    def flush_shards() -> None:
        nonlocal next_shard
        while next_shard < last_shard:
            lo, hi = next_shard * shard_size, min(len(conversations), (next_shard + 1) * shard_size)
            if any(i not in done for i in range(lo, hi)):
                return
            lines, entry = [], {"file": _shard_name(next_shard), "first": lo, "count": hi - lo,
                                "written": 0, "new_tokens": 0, "skipped": [], "truncated": []}
            for i in range(lo, hi):
                kind, value = done.pop(i)
                cid = conversations[i].id
                if kind == "skip":
                    entry["skipped"].append({"id": cid, "reason": value})
                    continue
                line, cut = value
                lines.append(_dumps(line) + "\n")
                entry["written"] += 1
                entry["new_tokens"] += sum(line["meta"]["new_tokens"])
                if cut is not None:
                    entry["truncated"].append({"id": cid, "reason": cut})
            data = "".join(lines).encode("utf-8")
            entry["sha256"] = hashlib.sha256(data).hexdigest()
            _write_atomic(out_dir / entry["file"], data)
            # The manifest is updated after the shard lands: a kill in between only means the
            # shard is made again (identically) by the restart.
            manifest["shards"].append(entry)
            _write_atomic(out_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
            account(entry)
            next_shard += 1

    streamed = 0
    try:
        while True:
            while len(in_flight) < window and next_index < end:
                c = conversations[next_index]
                kept, cuts = split_turns(c.messages)
                work = _Work(next_index, c, kept, cuts[:1] if turns == "first" else cuts)
                next_index += 1
                if not work.cuts:
                    finish(work, skip="no user turn to answer")
                else:
                    ask(work)
            flush_shards()
            if not in_flight:
                if next_index >= end:
                    break
                continue
            for event in engine.step():
                streamed += len(event.token_ids)
                if not event.finished:
                    continue
                work = in_flight.pop(event.request_id)
                # take_output forgets it: a run over many thousand conversations must not keep
                # every output in the engine.
                out = engine.take_output(event.request_id)
                report.new_tokens += len(out.token_ids)
                if out.finish_reason == FinishReason.ERROR:
                    cut_short(work, out.error or "the engine failed this request")
                    continue
                work.messages.append({"role": "assistant", "content": out.text})
                work.finish_reasons.append(out.finish_reason)
                work.new_tokens.append(len(out.token_ids))
                work.turn += 1
                if work.turn < len(work.cuts):
                    ask(work)
                else:
                    finish(work)
            elapsed = time.perf_counter() - started
            if elapsed > 0:
                bar.set_postfix_str(f"{streamed / elapsed:.1f} tok/s", refresh=False)
    finally:
        bar.close()
        report.seconds = time.perf_counter() - started
    return report
