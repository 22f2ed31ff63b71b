"""Regeneration of assistant turns by the target: faithful to the engine, order-stable, resumable."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specforge.config import EngineConfig
from specforge.conversations.chat import Conversation
from specforge.data.regeneration import (
    MANIFEST,
    RegenerationError,
    iter_regenerated,
    regenerate,
    split_turns,
    target_sampling,
    turn_seed,
)
from specforge.engine import Engine, GenerationRequest
from specforge.plugins import get_host
from specforge.runtime import TargetModel, load_target
from tiny_models import save_tiny, save_tokenizer

CONTEXT = 64
SETTINGS = dict(max_new_tokens=6, shard_size=4, max_context=CONTEXT, progress=False)


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny("llama", d, seed=5)
    save_tokenizer(d)
    return load_target(str(d), dtype="float32", backend="torch")


def dataset() -> list[Conversation]:
    convs = []
    for i in range(10):
        messages = [user(words(5 + i, 6, 7 + i)), bot(words(9, 9, 9))]
        if i % 2:
            messages += [user(words(20 + i, 21)), bot(words(9, 9))]
        convs.append(Conversation(f"c{i}", messages))
    convs[3].messages.insert(0, {"role": "system", "content": words(40, 41)})
    convs.append(Conversation("too-long", [user(words(*range(10, 10 + CONTEXT)))]))
    # The first turn fits; the second prompt (first answer + this long message) does not.
    convs.append(Conversation("long-second", [user(words(11)), bot(words(9)), user(words(*range(10, 60)))]))
    convs.append(Conversation("open-end", [user(words(30)), bot(words(9)), user(words(31, 32))]))
    return convs


def plain_engine(target, batch: int) -> Engine:
    return Engine(target, get_host().create_verifier("rejection"),
                  engine=EngineConfig(max_batch=batch, max_context=CONTEXT))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def read_lines(directory: Path) -> dict[str, dict]:
    out = {}
    for shard in sorted(directory.glob("regen-*.jsonl")):
        for line in shard.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            out[record["id"]] = record
    return out


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    """One uninterrupted run with 8 slots: the output every other run must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    report = regenerate(dataset(), target, out, max_batch=8, **SETTINGS)
    return out, report


def test_assistant_turns_are_the_engines_answers(target, reference):
    out, report = reference
    records = read_lines(out)
    assert report.complete and report.total_shards == 4
    assert list(records) == [c.id for c in dataset() if c.id != "too-long"]  # input order
    manifest = json.loads((out / MANIFEST).read_text())
    # tiny_models' checkpoint recommends no sampling, so the target's own law (T=1) is used.
    assert manifest["sampling"]["temperature"] == 1.0 and manifest["sampling"]["turns"] == "all"
    for conv in dataset():
        if conv.id in ("too-long", "long-second"):
            continue
        got = records[conv.id]["messages"]
        asked = [m for m in conv.messages if m["role"] != "assistant"]
        assert [m for m in got if m["role"] != "assistant"] == asked
        assert [m["role"] for m in got][-1] == "assistant"
        assert len(records[conv.id]["meta"]["new_tokens"]) == len(conv.user_turns)
    # The second answer of c1, asked again directly with its seed, is the same text.
    conv = records["c1"]["messages"]
    engine = plain_engine(target, 1)
    direct = engine.generate([GenerationRequest(prompt=conv[:3], seed=turn_seed("c1", 1, 0), max_new_tokens=6,
                                                temperature=1.0, top_k=0, top_p=1.0)])[0]
    assert direct.text == conv[3]["content"]
    written = direct.token_ids[:-1] if direct.finish_reason == "eos" else direct.token_ids
    assert conv[3]["token_ids"] == written  # the ids as the target wrote them, for training
    assert records["c1"]["meta"]["new_tokens"][1] == len(direct.token_ids)
    assert records["c1"]["meta"]["finish_reasons"][1] == direct.finish_reason
    assert list(c.id for c in iter_regenerated(out)) == list(records)


def test_too_long_prompts_are_skipped_or_cut_and_reported(reference):
    out, report = reference
    skipped = dict(report.skipped)
    assert list(skipped) == ["too-long"] and "context limit of 64" in skipped["too-long"]
    truncated = dict(report.truncated)
    assert list(truncated) == ["long-second"] and truncated["long-second"].startswith("turn 2:")
    kept = read_lines(out)["long-second"]["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant"]  # the answered turn stays
    assert report.written == len(dataset()) - 1 and report.conversations == len(dataset())


def test_batch_size_does_not_change_the_output(target, reference, tmp_path):
    regenerate(dataset(), target, tmp_path, max_batch=2, **SETTINGS)
    assert snapshot(tmp_path) == snapshot(reference[0])


def test_killed_run_resumes_to_identical_files(target, reference, tmp_path, monkeypatch):
    first = regenerate(dataset(), target, tmp_path, max_batch=3, max_shards=1, **SETTINGS)
    assert first.shards == 1 and not first.complete
    # A second kill mid-shard: an exception from inside the engine loop, and a half-written file.
    engine = plain_engine(target, 3)
    calls = {"n": 0}
    step = engine.step

    def dying_step():
        calls["n"] += 1
        if calls["n"] > 12:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        regenerate(dataset(), engine, tmp_path, **SETTINGS)
    done = json.loads((tmp_path / MANIFEST).read_text())["shards"]
    assert 1 <= len(done) < 4
    (tmp_path / f"regen-{len(done):05d}.jsonl.tmp").write_text("half a line")
    resumed = regenerate(dataset(), target, tmp_path, max_batch=5, **SETTINGS)
    assert resumed.complete and resumed.resumed_shards == len(done)
    assert snapshot(tmp_path) == snapshot(reference[0])


def test_mismatched_directory_is_refused_untouched(target, reference):
    out = reference[0]
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    changed = dataset()
    changed[2].messages[0]["content"] = words(1, 2, 3)
    with pytest.raises(RegenerationError, match=r"other inputs or settings(.|\n)*source"):
        regenerate(changed, target, out, max_batch=8, **SETTINGS)
    with pytest.raises(RegenerationError, match=r"sampling"):
        regenerate(dataset(), target, out, max_batch=8, temperature=0.5, **SETTINGS)
    with pytest.raises(RegenerationError, match=r"source"):
        regenerate(dataset()[:-1], target, out, max_batch=8, **SETTINGS)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_first_turn_only(target, tmp_path):
    report = regenerate(dataset()[:4], target, tmp_path, turns="first", max_batch=4, **SETTINGS)
    records = read_lines(tmp_path)
    assert report.complete and len(records) == 4
    for conv in dataset()[:4]:
        got = records[conv.id]["messages"]
        system = [m["role"] for m in conv.messages if m["role"] == "system"]
        assert [m["role"] for m in got] == system + ["user", "assistant"]
        assert got[-2]["content"] == conv.user_turns[0]


def test_split_turns():
    # Consecutive user messages are one turn; a reply to nothing is dropped; an open end is answered.
    kept, cuts = split_turns([bot("hi"), user("a"), user("b"), bot("x"), bot("y"), user("c")])
    assert kept == [user("a"), user("b"), user("c")] and cuts == [2, 3]
    sharegpt = [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]
    assert split_turns(sharegpt) == ([{"role": "system", "content": "s"}, user("q")], [2])
    # a blank user message is no prompt: neither it nor a reply to it is kept (the loaders refuse
    # a conversation whose only user turn is blank, so its answer would be unreadable training data)
    assert split_turns([user(" "), bot("x"), user("q"), bot("r")]) == ([user("q")], [1])
    assert split_turns([user(""), bot("x")]) == ([], [])


def test_the_source_fingerprint_is_what_it_was_before_blank_prompts_were_dropped():
    # The value the code before that change computed (commit 6d83554): a directory regenerated
    # then is still recognised as made from the same conversations, and resumes or is reused.
    from specforge.data.regeneration import _fingerprint

    conversations = [Conversation(id="blank", messages=[user("  "), bot("x"), user("q")]),
                     Conversation(id="plain", messages=[{"role": "system", "content": "s"}, user("hi"), bot("r")])]
    assert _fingerprint(conversations) == "8240e4369b263e29be5b536dd07e96f263ff98ba68d82d50dbac84ceed5a0b2d"


def test_target_sampling_reads_only_what_the_checkpoint_sets():
    from transformers import GenerationConfig

    def fake(**kw):
        return SimpleNamespace(hf_model=SimpleNamespace(generation_config=GenerationConfig(**kw)))

    assert target_sampling(fake()) == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    recommended = target_sampling(fake(do_sample=True, temperature=0.7, top_p=0.9))
    assert recommended == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    assert target_sampling(fake(do_sample=False))["temperature"] == 0.0


def test_training_config_sampling_reaches_the_regeneration(target, tmp_path):
    """data.regenerate.temperature/top_k/top_p override the checkpoint's recommendation (for a
    model whose recommended sampling lives only on its model card) and are pinned in the manifest."""
    from specforge.training.config import TrainConfig
    from specforge.training.data import regenerate_answers

    source = tmp_path / "convs.jsonl"
    source.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in dataset()[:3]))
    config = TrainConfig.model_validate({"data": {"source": str(source), "regenerate": {
        "enabled": True, "max_new_tokens": 4, "shard_size": 2, "temperature": 0.0, "top_k": 3, "top_p": 0.5}}})
    out = regenerate_answers(config, target, tmp_path / "run", log=lambda _: None, progress=False)
    sampling = json.loads((out / MANIFEST).read_text())["sampling"]
    assert (sampling["temperature"], sampling["top_k"], sampling["top_p"]) == (0.0, 3, 0.5)
