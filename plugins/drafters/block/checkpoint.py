"""Block-drafter checkpoints: one safetensors file of weights plus a JSON config (never pickle).

Layout of a checkpoint directory::

    config.json        {"format", "version", "method", "target",
                        "backbone": {...}, "head": {"name", "config"} | null,
                        "confidence": {"name", "config"} | null, "drafter": {...},
                        "files": {"model.safetensors": {"bytes", "sha256"}}}
    model.safetensors  "backbone.*", "head.*", "confidence.*" tensors, and with a draft vocabulary
                       "vocab.d2t" / "vocab.t2d" (EAGLE-3's maps, see specforge.vocab)

The directory, the weights' integrity record and the errors are those of every drafter checkpoint
(:mod:`specforge.toolkit.checkpoints`).  The target's shared embedding and LM head are
not in it (they are the target's).  A confidence
head tied to the correction head's W1 has no table of its own and is re-tied on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from specforge.toolkit.checkpoints import read_checkpoint, read_vocab, vocab_tensors, write_checkpoint
from specforge.toolkit.confidence_head import CONFIDENCE_HEADS
from specforge.toolkit.heads import HEADS
from specforge_plugins.drafters.block.config import BlockDrafterConfig
from specforge_plugins.drafters.block.model import BlockBackbone

__all__ = ["FORMAT", "VERSION", "load_drafter", "save_drafter"]

FORMAT, VERSION = "specforge-block-drafter", 1
# The heads a checkpoint can hold, by the name its config.json records (the components' names).
_NETWORKS: dict[str, type[nn.Module]] = {**HEADS, **CONFIDENCE_HEADS}


def _layout_name(config: BlockDrafterConfig) -> str:
    return "dspark" if config.predict_anchor else "dflash"


def _spec(module: nn.Module | None) -> dict[str, Any] | None:
    if module is None:
        return None
    if not module.built:
        raise ValueError(f"{type(module).__name__} is not built (bind it to the target first)")
    name = next((n for n, cls in _NETWORKS.items() if type(module) is cls), None)
    if name is None:
        raise ValueError(f"{type(module).__name__} is not a known head; known: {', '.join(_NETWORKS)}")
    # The built config carries vocab_size/dim; ``weights`` would point outside, so it is dropped.
    return {"name": name, "config": {**module.config.model_dump(mode="json"), "weights": None}}


def save_drafter(directory: str | Path, backbone: BlockBackbone, head: nn.Module | None = None,
                 confidence: nn.Module | None = None, config: dict[str, Any] | None = None, *,
                 method: str | None = None, target: str | None = None) -> Path:
    """Write ``backbone`` (+ correction ``head`` + ``confidence`` head) and a drafter-level
    ``config`` (free-form JSON: γ policy, provenance, …) into ``directory``.  ``method`` (the
    training method, ``dspark``/``dflash``) and ``target`` (the target it was trained for) are
    recorded at the top of config.json; checkpoints written before they existed load too."""
    meta = {"format": FORMAT, "version": VERSION, "method": method or _layout_name(backbone.config),
            "target": target, "backbone": backbone.config.model_dump(mode="json"),
            "head": _spec(head), "confidence": _spec(confidence), "drafter": config or {}}
    tensors = vocab_tensors(backbone.vocab)
    for prefix, module in (("backbone", backbone), ("head", head), ("confidence", confidence)):
        if module is not None:
            tensors.update({f"{prefix}.{k}": v for k, v in module.state_dict().items()})
    return write_checkpoint(directory, meta, tensors)


def load_drafter(directory: str | Path) -> tuple[BlockBackbone, nn.Module | None, nn.Module | None, dict[str, Any]]:
    """Read a checkpoint written by :func:`save_drafter`.

    ``directory`` may name a shipped drafter (``shipped:<name>``).  Returns
    ``(backbone, head, confidence, drafter_config)``; the backbone still needs
    ``bind(SharedWeights.from_target(target))`` before it runs.
    """
    meta, tensors = read_checkpoint(directory, FORMAT, VERSION, "dspark/dflash")
    directory = Path(str(directory))

    def part(prefix: str) -> dict[str, Any]:
        return {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}

    vocab = read_vocab(tensors, directory)
    backbone = BlockBackbone(BlockDrafterConfig.model_validate(meta["backbone"]), vocab=vocab)
    backbone.load_state_dict(part("backbone"))  # strict: a missing or extra tensor is an error
    modules: dict[str, nn.Module | None] = {}
    for key in ("head", "confidence"):
        spec = meta.get(key)
        if spec is None:
            modules[key] = None
            continue
        cls = _NETWORKS[spec["name"]]
        module = cls(cls.config_model.model_validate(spec["config"]))
        state = part(key)
        if "token_rows" in state:  # trained over the draft vocabulary: its shape first
            module.restrict(state["token_rows"])
        module.load_state_dict(state)
        modules[key] = module
    head, confidence = modules["head"], modules["confidence"]
    if confidence is not None and confidence.config.embedding == "head":
        if head is None:
            raise ValueError(f"{directory}: the confidence head is tied to a correction head that is absent")
        confidence.tie(head)
    return backbone, head, confidence, meta.get("drafter", {})
