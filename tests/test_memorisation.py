"""The memorisation check (docs/reference-run.md#memorisation) for every trainable block drafter and
EAGLE-3: trained on a tiny target's own greedy answers until they are learnt, then decoded greedily
on the same prompts with every drafted token verified, a drafter whose inputs are right (tapped
layer, label shift, attention mask, positions) approaches τ = γ + 1.  A defect on that path caps
τ whatever the data; this is the test that would have caught one.  Slow tier: it trains."""

from __future__ import annotations

import json

import pytest

from specforge.bench.drafters import load_bench_config, run_drafters_bench
from tiny_models import save_tiny

GAMMA = 4


def _save_round_trip_tokenizer(directory, vocab: int) -> None:
    """The word-level tokenizer of the other tests ("w0" … id = number), made to round-trip:
    regenerated answers are stored as text and tokenised again for training, so a tokenizer whose
    special tokens match inside words ("w1" in "w11") would train the drafter on other tokens
    than the target wrote.  Its chat template opens the assistant turn in the generation prompt as
    the conversation's rendering does (SmolLM2's does)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {k: AddedToken(w, single_word=True, special=True)
               for k, w in (("bos_token", "w0"), ("eos_token", "w1"), ("unk_token", "w2"), ("pad_token", "w0"))}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    fast.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w4 {% endfor %}"
                          "{% if add_generation_prompt %}w3 {% endif %}")
    assert fast("w5 w11 w25 w1")["input_ids"] == [5, 11, 25, 1]
    fast.save_pretrained(directory)


@pytest.mark.slow
def test_every_block_drafter_and_eagle3_memorise_the_targets_greedy_answers(tmp_path):
    model = save_tiny("llama", tmp_path / "model", vocab=96)
    _save_round_trip_tokenizer(model, vocab=96)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(f"w{5 + (7 * i + 3 * j) % 80}" for j in range(5))},
        {"role": "assistant", "content": "w9"}]}) + "\n" for i in range(6)))
    train = tmp_path / "train.yaml"
    train.write_text(
        f"target: {{model: '{model}', dtype: float32}}\n"
        f"data: {{source: '{chats}', max_length: 64, eval_sequences: 0,"
        " regenerate: {enabled: true, max_new_tokens: 24, max_batch: 1, shard_size: 8, temperature: 0}}\n"
        "features: {mode: offline, dtype: float32, sequences_per_shard: 8}\n"
        "optimizer: {lr: 3e-3, weight_decay: 0}\nschedule: {total_steps: 1, warmup_steps: 5, min_lr: 1e-3}\n"
        "batch: {sequences: 6, anchors: 64}\noutput: {progress: false}\ndevice: cpu\ndtype: float32\n")
    block = f"layers: 2, gamma: {GAMMA}, target_layers: [0, 1, 2]"
    fixed = ["scheduler.name=fixed"]
    bench = load_bench_config([], [
        f"train=['{train}']", "steps=300", "eval_points=1", "on_training_prompts=true",
        f"methods.dspark.drafter={{name: dspark, {block}, head: {{name: markov, rank: 16}}, confidence: {{name: none}}}}",
        f"methods.dspark.serve={fixed}",
        f"methods.dflash.drafter={{name: dflash, {block}}}", f"methods.dflash.serve={fixed}",
        f"methods.eagle3.drafter={{name: eagle3, steps: {GAMMA}}}", f"methods.eagle3.serve={fixed}",
        "prompts=6", "max_new_tokens=20", "temperatures=[0.0]", f"out={tmp_path / 'out'}"])
    result = run_drafters_bench(bench, say=lambda msg: None)
    taus = {name: arm["summary"]["T=0"]["tau"] for name, arm in result["arms"].items()}
    # Measured: 4.0 / 4.0 / 3.75 of γ + 1 = 5 after 300 steps; with the answers' ids re-tokenised
    # from text (before they were kept) 3.2 / 2.9 / 3.0, with a generation prompt that opened the
    # turn differently from the training text 1.4 / 1.3 / 1.3.
    assert all(tau >= 0.7 * (GAMMA + 1) for tau in taus.values()), taus
