"""``target.backend`` decided once, with what the caller needs (specforge/runtime/choice.py), and a
target that keeps it: the decision's branches on stand-in backends, then on a real tiny target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specforge.errors import ConfigError
from specforge.runtime import Needs, TargetModel, load_target
from specforge.runtime import choice as choice_mod
from specforge.runtime.choice import BackendChoice, choose_backend


class Stand:
    """A backend that lacks the taps at or above ``top``."""

    def __init__(self, name: str, top: int | None = None) -> None:
        self.name, self.top, self.opened = name, top, 0

    def lacks(self, needs: Needs) -> str | None:
        bad = [i for i in needs.taps if self.top is not None and i >= self.top]
        return f"cannot tap layer {bad[0]}" if bad else None


def _seconds(faster: str) -> dict:
    slow, fast = {p: 0.02 for p in choice_mod.PASSES}, {p: 0.01 for p in choice_mod.PASSES}
    return {"llama.cpp": fast, "torch": slow} if faster == "llama.cpp" else {"llama.cpp": slow, "torch": fast}


def _choose(request: str, needs: Needs, monkeypatch, *, can_run: str | None = None, faster: str = "llama.cpp"):
    torch_b, llama_b, said = Stand("torch"), Stand("llama.cpp", top=29), []

    def open_llamacpp():
        llama_b.opened += 1
        return llama_b

    monkeypatch.setattr(choice_mod, "where_llamacpp_cannot_run", lambda gguf: can_run)
    monkeypatch.setattr(choice_mod, "resolve_backend", lambda name, backends, vocab, key, say, requests, drafts: (
        say(f"measured → {faster}") or BackendChoice(_seconds(faster))))
    got = choose_backend(request, torch_b, open_llamacpp, Path("t.gguf"), needs, name="t", vocab=8,
                         key=lambda: "k", log=said.append)
    return got.name, said, llama_b.opened


def test_auto_takes_llama_cpp_where_it_serves_the_needs_and_measured_faster(monkeypatch):
    assert _choose("auto", Needs((3, 28)), monkeypatch) == ("llama.cpp", ["measured → llama.cpp"], 1)
    assert _choose("auto", Needs((3,)), monkeypatch, faster="torch")[:2] == ("torch", ["measured → torch"])


def test_auto_takes_torch_where_llama_cpp_lacks_a_need_and_says_why_once(monkeypatch):
    name, said, _ = _choose("auto", Needs((3, 29)), monkeypatch)
    assert name == "torch" and said == ["target.backend: auto → torch (cannot tap layer 29)"]
    name, said, opened = _choose("auto", Needs(), monkeypatch, can_run="the target is a safetensors directory")
    assert (name, opened) == ("torch", 0) and said == ["target.backend: auto → torch (the target is a safetensors "
                                                       "directory)"]


def test_a_named_backend_is_the_users_word(monkeypatch):
    assert _choose("torch", Needs((29,)), monkeypatch) == ("torch", [], 0)
    assert _choose("llama.cpp", Needs((3,)), monkeypatch)[:2] == ("llama.cpp", [])
    with pytest.raises(ConfigError, match="cannot tap layer 29; use target.backend=torch"):
        _choose("llama.cpp", Needs((3, 29)), monkeypatch)
    with pytest.raises(ValueError, match="backend must be one of auto, torch, llama.cpp; got 'cuda'"):
        load_target("no/such/model", backend="cuda")  # refused before anything is looked for or loaded


def test_needs_combine_and_a_target_keeps_its_backend():
    from tiny_models import tiny_model

    assert (Needs((1, 3)) | Needs((3, 5), final_hidden=True)) == Needs((1, 3, 5), True)
    lacking = Stand("llama.cpp", top=1)
    target = TargetModel(tiny_model("llama", vocab=32), None, torch.float32, name="tiny", backend=lacking)
    assert target.backend is lacking and target.teacher().name == "torch"
    with pytest.raises(ConfigError, match="target.backend: llama.cpp was decided when the target loaded, and "
                                          "cannot tap layer 1"):
        target.require(Needs((0, 1)))
    target.require(Needs((0,)))
    assert target.backend is lacking  # never swapped


def test_drafters_say_what_they_tap_before_they_bind():
    """The shipped drafters' ``taps_for`` equals what ``bind`` sets, so the loader decides right."""
    from specforge.engine.bind import drafter_needs
    from specforge.plugins import get_host
    from tiny_models import tiny_model

    target = TargetModel(tiny_model("llama", vocab=64, layers=6), None, torch.float32, name="tiny")
    host = get_host()
    for name in ("dspark", "dflash", "eagle3", "medusa"):
        drafter = host.create_drafter(name)
        declared = drafter_needs(drafter)(target.args)
        drafter.bind(target)
        assert declared.taps == tuple(drafter.feature_layers), name


def test_auto_decides_on_the_passes_of_the_load_it_serves(monkeypatch):
    """A single user gets the backend faster on one request's passes, a batched server the one
    faster on the batched decode step — from one measurement, said with its numbers."""
    seconds = {"llama.cpp": {"decode-1": 0.009, "decode-8": 0.039, "verify-8": 0.026},
               "torch": {"decode-1": 0.013, "decode-8": 0.029, "verify-8": 0.042}}
    measured = BackendChoice(seconds)
    assert measured.for_load(1) == "llama.cpp" and measured.for_load(64) == "torch"
    assert measured.for_load(None) == ("llama.cpp" if measured.speedup() >= 1 else "torch")
    line = measured.describe(1)
    assert line.startswith("target.backend: auto → llama.cpp for 1 request at a time") and "decode-1 9.0 vs 13.0 ms" in line
    assert measured.describe(64).startswith("target.backend: auto → torch for 64 requests at a time")
    said = []
    monkeypatch.setattr(choice_mod, "where_llamacpp_cannot_run", lambda gguf: None)
    for requests, want in ((1, "llama.cpp"), (64, "torch")):
        monkeypatch.setattr(choice_mod, "resolve_backend", lambda name, backends, vocab, key, say, n, drafts: (
            say(measured.describe(n, drafts)) or measured))
        got = choose_backend("auto", Stand("torch"), lambda: Stand("llama.cpp"), Path("t.gguf"),
                             Needs(requests=requests), name="t", vocab=8, key=lambda: "k", log=said.append)
        assert got.name == want
    assert len(said) == 2 and (Needs(requests=1) | Needs(requests=64)).requests == 64


def test_a_single_user_decoding_plainly_is_decided_on_the_decode_step_alone():
    """Measured on the AVX512-BF16 EPYC: llama.cpp's one-row step is faster, its 8-token verify
    pass slower — plain decoding never runs the verify pass, a drafting pipeline does."""
    from specforge.engine.bind import drafter_needs

    seconds = {"llama.cpp": {"decode-1": 0.0112, "decode-8": 0.0471, "verify-8": 0.0448},
               "torch": {"decode-1": 0.0138, "decode-8": 0.0314, "verify-8": 0.0266}}
    measured = BackendChoice(seconds)
    assert measured.for_load(1, drafts=False) == "llama.cpp" and measured.for_load(1, drafts=True) == "torch"
    assert measured.for_load(1) == "torch"  # not known: a drafting load is assumed
    assert measured.describe(1, False).startswith("target.backend: auto → llama.cpp for 1 request at a time, "
                                                  "plain decoding")
    assert (Needs(drafts=False) | Needs(drafts=True)).drafts is True and (Needs() | Needs(drafts=False)).drafts is False
    assert drafter_needs(None, 1)(None).drafts is False
