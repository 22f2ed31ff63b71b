"""``medusa`` checkpoints in vLLM's layout and in FasterDecoding/Medusa's (docs/interop.md).

Both apply K heads, each residual blocks x + SiLU(W x + b) then an output layer, to the target's
final-normed last hidden state — what ours compute — and differ only in names:

============================  ===============================  ==================================
ours (``heads.*``)            vLLM (``vllm/…/medusa.py``)       FasterDecoding (``medusa_lm_head``)
============================  ===============================  ==================================
``blocks.{h}.{l}.linear.w/b``  ``blocks.{h}.layers.{l}.w/b``    ``{h}.{l}.linear.w/b``
``out.{h}.weight`` [N, d]      ``lm_heads.{h}.weight``          ``{h}.{L}.weight`` [V, d]
``vocab.*`` (N < V)            ``token_map`` [N] target ids     — (whole vocabulary only)
============================  ===============================  ==================================

vLLM reads the bias only with ``medusa_fc_bias: true`` and a truncated vocabulary only with
``truncated_vocab_size`` and ``token_map``; it drops unknown keys silently, so an export writes
exactly these.  FasterDecoding's trainer saves ``medusa_lm_head.safetensors`` (its inference loader
reads a ``.pt`` pickle, which specforge never loads) and repeats one residual block object when
``medusa_num_layers`` > 1; importing gives each position its own (equal) copy.  A drafter whose
heads share the target's LM head (``output: shared``) stores no output layers and is not exported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from specforge.toolkit.formats import InteropError, load_tensors, mismatch, read_config
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.medusa.model import MedusaHeads, MedusaShape, load_medusa, save_medusa

__all__ = ["MEDUSA_FORMATS", "MedusaFormat"]


class MedusaFormat:
    """vLLM's (``vllm``) or FasterDecoding's (``medusa-1``) Medusa layout."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.weights = "model.safetensors" if name == "vllm" else "medusa_lm_head.safetensors"
        self.description = ("vLLM's MedusaModel (blocks.*, lm_heads.*, token_map)" if name == "vllm" else
                            "FasterDecoding/Medusa's medusa_lm_head.safetensors (Medusa-1 heads)")

    def _key(self, kind: str, h: int, index: int) -> str:
        if self.name == "vllm":
            return f"blocks.{h}.layers.{index}.{kind}" if kind in ("weight", "bias") else f"lm_heads.{h}.weight"
        return f"{h}.{index}.linear.{kind}" if kind in ("weight", "bias") else f"{h}.{index}.weight"

    # -- export ---------------------------------------------------------------------------------

    def export(self, source: Path, out: Path) -> list[str]:
        heads, drafter = load_medusa(source)
        s = heads.shape
        if s.output != "own":
            raise InteropError(f"{source}: its heads use the target's LM head (output: shared), which the "
                               "checkpoint does not hold; neither layout can state it")
        if heads.vocab is not None and self.name != "vllm":
            raise InteropError(f"{source}: a draft vocabulary of {s.draft_vocab_size} tokens; FasterDecoding's "
                               "heads always predict the whole vocabulary (export --to vllm keeps it)")
        state = heads.state_dict()
        tensors: dict[str, Tensor] = {}
        for h in range(s.heads):
            for l_ in range(s.res_layers):
                for kind in ("weight", "bias"):
                    tensors[self._key(kind, h, l_)] = state[f"blocks.{h}.{l_}.linear.{kind}"]
            tensors[self._key("out", h, s.res_layers)] = state[f"out.{h}.weight"]
        target = json.loads((source / "config.json").read_text()).get("target")
        if self.name == "vllm":
            config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": s.dim,
                      "vocab_size": s.vocab_size, "num_heads": s.heads, "num_hidden_layers": s.res_layers,
                      "medusa_fc_bias": True, "original_lm_head": False,
                      "truncated_vocab_size": s.draft_vocab_size or s.vocab_size}
            if heads.vocab is not None:
                tensors["token_map"] = heads.vocab.ids.clone()
        else:
            config = {"medusa_num_heads": s.heads, "medusa_num_layers": s.res_layers, "hidden_size": s.dim,
                      "vocab_size": s.vocab_size, "base_model_name_or_path": target, "version": "2"}
        config["specforge"] = {"method": "medusa", "target": target, "n_target_layers": s.n_target_layers,
                               "norm_eps": s.norm_eps, "drafter": drafter}
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / self.weights))
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return []

    # -- import ---------------------------------------------------------------------------------

    def detect(self, directory: Path) -> bool:
        config = read_config(directory)
        if config is None:
            return False
        if self.name == "vllm":
            return "MedusaModel" in (config.get("architectures") or [])
        return "medusa_num_heads" in config

    def import_checkpoint(self, directory: Path, out: Path, target: Any = None) -> list[str]:
        config = read_config(directory) or {}
        weights, tensors = load_tensors(directory, self.weights)
        tensors = {k.removeprefix("medusa_heads.").removeprefix("medusa_head."): v for k, v in tensors.items()}
        pattern = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)" if self.name == "vllm"
                             else r"(\d+)\.(\d+)\.linear\.(weight|bias)")
        blocks = [m.groups() for k in tensors if (m := pattern.fullmatch(k))]
        if not blocks:
            raise InteropError(f"{weights}: no residual-block tensors ({pattern.pattern})")
        k_heads = 1 + max(int(h) for h, _, _ in blocks)
        res = 1 + max(int(i) for _, i, _ in blocks)
        first = tensors[self._key("out", 0, res)] if self._key("out", 0, res) in tensors else None
        if first is None:
            raise InteropError(f"{weights}: the tensor {self._key('out', 0, res)!r} is missing")
        n, d = first.shape
        token_map = tensors.get("token_map")
        v = int(config.get("vocab_size") or (target.args.vocab_size if target is not None else n))
        vocab = DraftVocab(token_map.long(), v) if token_map is not None and n < v else None
        notes = []
        extra = config.get("specforge") or {}
        depth = extra.get("n_target_layers") or (target.args.n_layers if target is not None else None)
        if depth is None:
            raise InteropError(f"{directory}: the target's depth is not recorded; import with --target")
        try:
            shape = MedusaShape(vocab_size=v, dim=d, n_target_layers=int(depth),
                                norm_eps=float(extra.get("norm_eps") or (target.args.norm_eps if target else 1e-6)),
                                heads=k_heads, res_layers=res, draft_vocab_size=None if vocab is None else n)
        except ValueError as exc:
            raise InteropError(f"{directory / 'config.json'}: not a usable Medusa config ({exc})") from None
        if target is not None:
            a = target.args
            wrong = mismatch({k: (getattr(shape, k), getattr(a, t)) for k, t in
                              (("vocab_size", "vocab_size"), ("dim", "dim"), ("n_target_layers", "n_layers"))})
            if wrong:
                raise InteropError(f"{directory}: made for another target — {wrong}")
        state = {}
        for h in range(k_heads):
            for l_ in range(res):
                for kind in ("weight", "bias"):
                    key = self._key(kind, h, l_)
                    want = (d, d) if kind == "weight" else (d,)
                    if key not in tensors:
                        if kind == "bias":  # vLLM without medusa_fc_bias: zero biases
                            tensors[key] = torch.zeros(d, dtype=first.dtype)
                            notes.append(f"{key} absent: a zero bias")
                        else:
                            raise InteropError(f"{weights}: the tensor {key!r} is missing")
                    if tuple(tensors[key].shape) != want:
                        raise InteropError(f"{weights}: {key!r} has shape {tuple(tensors[key].shape)}, expected {want}")
                    state[f"blocks.{h}.{l_}.linear.{kind}"] = tensors[key]
            key = self._key("out", h, res)
            if key not in tensors:
                raise InteropError(f"{weights}: the tensor {key!r} is missing")
            if tuple(tensors[key].shape) != (n, d):
                raise InteropError(f"{weights}: {key!r} has shape {tuple(tensors[key].shape)}, expected {(n, d)}")
            state[f"out.{h}.weight"] = tensors[key]
        heads = MedusaHeads(shape, vocab=vocab).to(first.dtype)
        heads.load_state_dict(state)
        save_medusa(out, heads, {"kind": "medusa", "imported_from": str(directory), "format": self.name},
                    target=extra.get("target") or config.get("base_model_name_or_path"))
        return notes


MEDUSA_FORMATS = (MedusaFormat("vllm"), MedusaFormat("medusa-1"))
