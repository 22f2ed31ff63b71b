"""Training the block drafters (``dspark``, ``dflash``) through the training contract.

The method trains the backbone together with the pipeline components DSpark's round runs after
it — a trainable correction head (``markov``, ``gated`` or ``rnn``) and the ``dspark-head``
confidence estimator — as one module, on DSpark's objective (paper §3.3, eq. 9–12;
:func:`specforge.toolkit.losses.dspark_loss`).  The heads are the toolkit's networks
(:mod:`specforge.toolkit.heads`, :mod:`specforge.toolkit.confidence_head`), which the pipeline's
components of those names serve; only they can be trained here, since only they are saved in the
checkpoint.  One step:

1. the backbone drafts every packed block in one pass over the fused taps of the batch's
   sequences;
2. the correction head runs teacher-forced on the true previous tokens, the confidence head on
   the same inputs;
3. the loss compares the corrected draft law with the target's p_t at the supervised slots.

The checkpoint is :mod:`~specforge_plugins.drafters.block.checkpoint`'s format, which the
``dspark``/``dflash`` drafters load; :meth:`BlockTraining.pipeline` says which head and
confidence settings serve it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from torch import Tensor, nn

from specforge.errors import SectionError, SpecforgeError
from specforge.toolkit.checkpoints import DrafterCheckpointError
from specforge.toolkit.confidence_head import CONFIDENCE_HEADS
from specforge.toolkit.heads import HEADS
from specforge.toolkit.layers import SharedWeights
from specforge.toolkit.losses import dspark_loss
from specforge.toolkit.training import BatchModule, DataNeeds, DataSummary, LossOutput, MetricNames, TrainBatch
from specforge.toolkit.vocab_training import VocabTraining, same_vocab
from specforge.vocab import DraftVocab
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter
from specforge_plugins.drafters.block.config import BlockDrafterConfig
from specforge_plugins.drafters.block.model import MASK, BlockBackbone

__all__ = ["BlockTrainConfig", "BlockTraining", "DFlashTrainConfig", "DFlashTraining", "DrafterModule", "LossWeights",
           "dflash_decay"]

NONE = "none"  # no correction head / no confidence head

class LossWeights(BaseModel):
    """λ of L = λ_ce·L_ce + λ_tv·L_tv + λ_conf·L_conf (paper eq. 12) and the decay of the
    position weights w_k = exp(−(k−1)/decay)."""

    model_config = ConfigDict(extra="forbid")
    ce_weight: float = Field(0.1, ge=0)
    tv_weight: float = Field(0.9, ge=0)
    conf_weight: float = Field(1.0, ge=0)
    decay: float | None = Field(None, gt=0, description="γ_w of the position weights; None: γ (DSpark)")


# DFlash's γ_w per block size (Chen et al., 2026, §4); other sizes take γ/2, the table's trend.
DFLASH_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}


def dflash_decay(gamma: int) -> float:
    """DFlash's decay of its position-weighted cross-entropy for a block of ``gamma`` positions."""
    return DFLASH_DECAY.get(gamma, gamma / 2)


def _component(networks: dict[str, type[nn.Module]], label: str, value: Any, default: str) -> dict[str, Any]:
    """``{"name": …, <that network's keys>}`` validated against its config model; the result
    carries every key with its default, as the checkpoint's training config records it."""
    if not isinstance(value, dict):
        raise SectionError([("", f"expected a mapping with a name, got {value!r}")])
    raw = dict(value)
    name = raw.pop("name", default)
    if name == NONE and not raw:
        return {"name": NONE}
    if name not in networks:
        raise SectionError([("name", f"{name!r} is not a trainable {label}; choose one of: "
                                     f"{', '.join(sorted([*networks, NONE]))}")])
    model = networks[name].config_model
    try:
        config = model.model_validate(raw)
    except ValidationError as exc:
        valid = ", ".join(["name", *model.model_fields])
        raise SectionError([(".".join(map(str, e["loc"])), f"unknown key; valid keys: {valid}"
                             if e["type"] == "extra_forbidden" else e["msg"]) for e in exc.errors()]) from None
    return {"name": name, **config.model_dump(mode="json")}


class BlockTrainConfig(BaseModel):
    """The ``drafter.*`` keys of a training config for ``dspark`` and ``dflash``."""

    model_config = ConfigDict(extra="forbid")

    layers: int = Field(2, ge=1, description="draft transformer layers")
    gamma: int = Field(7, ge=1, description="draft positions per block")
    target_layers: list[int] | None = Field(None, description="tapped target layers; None: 5 spread from 1 to L-3")
    head: dict[str, Any] = Field(default_factory=lambda: {"name": "markov"}, validate_default=True,
                                 description="correction head trained with the backbone: name + its keys, or none")
    confidence: dict[str, Any] = Field(default_factory=lambda: {"name": "dspark-head"}, validate_default=True,
                                       description="confidence head trained with it: dspark-head + its keys, or none")
    seed: int = Field(0, description="seed of the backbone's initialisation")
    mask_token_id: int | None = Field(
        None, ge=0, description="a vocabulary id whose frozen embedding is the MASK input (DeepSpec's and vLLM's "
                                "layout); None: a learned MASK vector")
    qk_norm: bool | None = Field(
        True, description="per-head RMSNorm of queries and keys in the draft layers (the Qwen3 layout DeepSpec, "
                          "vLLM, SGLang and llama.cpp read; false: not exportable); null: as the target's layers "
                          "(the default before, which runs saved then record and resume with)")
    norm_init_scale: float | None = Field(
        0.1, gt=0, description="initial final-norm weights: this times the target's final norm "
                               "(the scale its LM head was trained on); None: ones")
    init_from_target: list[int] | None = Field(
        None, description="target layer ids (0-based, one per draft layer) whose weights start the draft layers "
                          "(attention, MLP and norms; the fusion layer stays random); None: a random start")
    init_from: str | None = Field(
        None, description="a saved drafter (directory or shipped:NAME) whose weights start this run: every tensor "
                          "of its backbone and heads, same names and shapes; per-head q/k norms it lacks start at "
                          "ones (a drafter saved without q/k norm, retrained in the exportable layout); its draft "
                          "vocabulary is kept, whatever the data's counts; None: a fresh start")
    loss: LossWeights = Field(default_factory=LossWeights)
    draft_vocab: int | None = Field(
        None, ge=1, description="N: draft only the N most frequent tokens of the training answers (the LM head, "
                                "the heads' tables and q cover them; d2t/t2d maps in the checkpoint); "
                                "None: the target's whole vocabulary")

    @field_validator("head", mode="before")
    @classmethod
    def _head(cls, value: Any) -> dict[str, Any]:
        return _component(HEADS, "correction head", value, "markov")

    @field_validator("confidence", mode="before")
    @classmethod
    def _confidence(cls, value: Any) -> dict[str, Any]:
        return _component(CONFIDENCE_HEADS, "confidence estimator", value, "dspark-head")

    @model_validator(mode="after")
    def _tie(self) -> BlockTrainConfig:
        if self.confidence.get("embedding") == "head" and self.head["name"] == NONE:
            raise ValueError("confidence.embedding='head' ties to the correction head's W1; head.name is 'none'")
        return self

    @field_validator("init_from_target")
    @classmethod
    def _one_each(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        layers = info.data.get("layers")
        if value is not None and layers is not None and len(value) != layers:
            raise ValueError(f"names {len(value)} target layers for {layers} draft layers (one each)")
        return value


class DrafterModule(BatchModule):
    """Backbone, correction head and confidence head as one module, so DDP wraps (and
    all-reduces) all of it at once."""

    def __init__(self, backbone: BlockBackbone, head: nn.Module | None, confidence: nn.Module | None) -> None:
        super().__init__()
        self.backbone, self.head, self.confidence = backbone, head, confidence

    def run(self, batch: TrainBatch) -> tuple[Tensor, Tensor | None]:
        hidden, logits = self.backbone(batch.block_ids, batch.ctx, batch.anchor_pos, ctx_valid=batch.ctx_valid,
                                       ctx_index=batch.ctx_index)
        if self.head is not None:
            logits = self.head.forward_train(logits, batch.prev_ids, hidden)
        conf = None if self.confidence is None else self.confidence.logits(hidden, batch.prev_ids)
        return logits, conf


def _network(networks: dict[str, type[nn.Module]], spec: dict[str, Any], vocab: DraftVocab | None,
             target: Any) -> nn.Module | None:
    """The head ``spec`` names (``None`` for none), over ``vocab`` and sized from ``target``."""
    if spec["name"] == NONE:
        return None
    cls = networks[spec["name"]]
    module = cls(cls.config_model.model_validate({k: v for k, v in spec.items() if k != "name"}))
    if vocab is not None:
        module.restrict(vocab.token_rows())
    module.bind(target)
    return module


def _start_from_target(backbone: BlockBackbone, runtime: nn.Module, layer_ids: list[int]) -> None:
    """Draft layer i starts as target layer ``layer_ids[i]`` (``drafter.init_from_target``)."""
    n = len(runtime.layers)
    for i, (layer, lid) in enumerate(zip(backbone.layers, layer_ids, strict=True)):
        if not 0 <= lid < n:
            raise SpecforgeError(f"drafter.init_from_target.{i}: target layer {lid} is outside the target's {n} layers")
        if not hasattr(runtime.layers[lid], "wqkv"):
            raise SpecforgeError(f"drafter.init_from_target.{i}: the target's layers hold no dense weights to copy "
                                 "(target.weights: native); load it with dense weights")
        layer.copy_from(runtime.layers[lid])


def _vocab_words(vocab: DraftVocab | None) -> str:
    return "the whole vocabulary" if vocab is None else f"a draft vocabulary of {vocab.size} tokens"


# Tensors a drafter saved before q/k norm was the default lacks: they start at ones, where a fresh
# drafter's do, so the rest of the network starts where it left off.
_MAY_LACK = ("q_norm.weight", "k_norm.weight")


def _warm_start(module: DrafterModule, start: DrafterModule, source: str) -> None:
    """Copy ``start``'s weights into ``module`` (``drafter.init_from``): same names and shapes,
    except the per-head q/k norms ``start`` may lack."""
    mine, theirs = module.state_dict(), start.state_dict()
    missing = [k for k in mine if k not in theirs and not k.endswith(_MAY_LACK)]
    extra = [k for k in theirs if k not in mine]
    shapes = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in mine.items()
              if k in theirs and theirs[k].shape != v.shape]
    if missing or extra or shapes:
        what = "; ".join(part for part in (
            f"this run's config has {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''} it lacks" if missing else "",
            f"it has {', '.join(extra[:3])}{' …' if len(extra) > 3 else ''} this config lacks" if extra else "",
            f"other shapes: {', '.join(shapes[:3])}" if shapes else "") if part)
        raise DrafterCheckpointError(f"drafter.init_from: {source} does not fit this run's drafter ({what}); "
                                     "use the same layers, γ, target layers, heads and ranks")
    with torch.no_grad():
        for key, value in theirs.items():
            mine[key].copy_(value)


class BlockTraining(VocabTraining):
    """One training run of a DSpark-layout block drafter (see the module docstring)."""

    method = "dspark"
    predict_anchor = True
    config = BlockTrainConfig
    metrics = MetricNames(means=("ce", "tv", "conf", "tau"), sums=("supervised",), positions=("accept_rate",))

    def _block_config(self, vocab: DraftVocab | None) -> BlockDrafterConfig:
        c = self.settings
        return BlockDrafterConfig.from_model_args(
            self.target.args, draft_layers=c.layers, gamma=c.gamma, predict_anchor=self.predict_anchor,
            target_layers=tuple(c.target_layers) if c.target_layers is not None else None,
            draft_vocab_size=None if vocab is None else vocab.size, mask_token_id=c.mask_token_id,
            qk_norm=self.target.args.qk_norm if c.qk_norm is None else c.qk_norm)

    def _build(self, vocab: DraftVocab | None) -> DrafterModule:
        config, target, device = self.settings, self.target, self.device
        rt = target.runtime
        backbone = BlockBackbone(self._block_config(vocab), SharedWeights.from_target(rt, device), seed=config.seed,
                                 vocab=vocab)
        if config.norm_init_scale is not None:  # the frozen LM head was trained on the target's norm's scale
            with torch.no_grad():
                backbone.norm.weight.copy_(config.norm_init_scale * rt.norm.detach().float())
        if config.init_from_target is not None:
            _start_from_target(backbone, rt, config.init_from_target)
        head = _network(HEADS, config.head, vocab, target)
        confidence = _network(CONFIDENCE_HEADS, config.confidence, vocab, target)
        if confidence is not None and confidence.config.embedding == "head":
            confidence.tie(head)
        return DrafterModule(backbone, head, confidence).to(device)

    def prepare(self, summary: DataSummary) -> None:
        """With ``init_from``: the starting drafter's draft vocabulary (its rows mean those tokens),
        then its weights; otherwise the data's (:class:`VocabTraining`)."""
        if self.settings.init_from is None:
            super().prepare(summary)
            return
        source = self.settings.init_from
        backbone, head, confidence, _ = load_drafter(source)
        if self._module is None:
            if backbone.vocab is None or backbone.vocab.size != self.settings.draft_vocab:
                raise DrafterCheckpointError(
                    f"drafter.init_from: {source} drafts from {_vocab_words(backbone.vocab)}; this run's "
                    f"drafter.draft_vocab is {self.settings.draft_vocab} (set it to the same)")
            self.vocab = backbone.vocab
            if summary.token_counts is not None:  # how much of this run's answers the kept vocabulary covers
                counts = summary.token_counts.float()
                self.coverage = float(counts[self.vocab.ids].sum() / counts.sum().clamp_min(1))
            self._module = self._build(self.vocab)
        elif backbone.vocab is not None:
            raise DrafterCheckpointError(f"drafter.init_from: {source} drafts from {_vocab_words(backbone.vocab)}; "
                                         f"set drafter.draft_vocab={backbone.vocab.size}")
        _warm_start(self._module, DrafterModule(backbone, head, confidence), source)

    def needs(self) -> DataNeeds:
        c = self._block_config(self.vocab)
        return DataNeeds(layers=tuple(c.tap_layers), block=c.gamma, input_len=c.block_len,
                         mask_token_id=MASK if c.mask_token_id is None else c.mask_token_id,
                         token_counts=self.settings.draft_vocab is not None)

    def loss(self, outputs: tuple[Tensor, Tensor | None], batch: TrainBatch) -> LossOutput:
        logits, conf = outputs
        w = self.settings.loss
        labels, p_t, outside = batch.labels, batch.p_t, None
        if self.vocab is not None:  # the draft law covers N tokens: p_t there, the rest is outside
            ids = self.vocab.ids.to(p_t.device)
            p_t = p_t[..., ids]
            outside = (1 - p_t.sum(-1)).clamp_min(0)
            labels = self.vocab.to_draft(labels.clamp_min(0)).masked_fill(labels < 0, -1)
        res = dspark_loss(logits, labels, p_t, batch.valid, conf, gamma=w.decay or self.settings.gamma,
                          ce_weight=w.ce_weight, tv_weight=w.tv_weight, conf_weight=w.conf_weight, outside=outside)
        return LossOutput(total=res.total, blocks=res.mask[:, 0].sum(),
                          means={"ce": res.ce, "tv": res.tv, "conf": res.conf, "tau": res.tau},
                          sums={"supervised": res.mask.sum().float()},
                          positions={"accept_rate": (res.c_star.sum(0), res.mask.sum(0).float())})

    def save(self, directory: Path, provenance: dict[str, Any]) -> None:
        m = self.module
        save_drafter(directory, m.backbone, m.head, m.confidence,
                     {"kind": self.method, "gamma": self.settings.gamma, **provenance, **self.vocab_record()},
                     method=self.method, target=self.target_name)

    def load(self, directory: Path) -> None:
        backbone, head, confidence, _ = load_drafter(directory)
        mine = self.module.backbone.config.qk_norm
        if backbone.config.qk_norm != mine:  # before q/k norm was the default: runs saved without it
            raise DrafterCheckpointError(
                f"{directory}: a drafter {'with' if backbone.config.qk_norm else 'without'} q/k norm and this run's "
                f"config (drafter.qk_norm) asks {'for' if mine else 'against'} it; resume with "
                f"drafter.qk_norm={'true' if backbone.config.qk_norm else 'false'}, or start a new run")
        if not same_vocab(backbone.vocab, self.vocab):
            raise DrafterCheckpointError(f"{directory}: its draft vocabulary differs from the one this run's data "
                                         "gives (resume with the same data and drafter.draft_vocab)")
        m = self.module
        for mine, loaded, name in ((m.backbone, backbone, "backbone"), (m.head, head, "correction head"),
                                   (m.confidence, confidence, "confidence head")):
            if (mine is None) != (loaded is None) or (mine is not None and type(mine) is not type(loaded)):
                raise DrafterCheckpointError(f"{directory}: the checkpoint's {name} "
                                             f"({type(loaded).__name__ if loaded is not None else 'none'}) does "
                                             f"not match the config's ({type(mine).__name__ if mine is not None else 'none'})")
            if mine is not None:
                mine.load_state_dict(loaded.state_dict())

    def pipeline(self, directory: Path) -> dict[str, Any]:
        head, conf = self.settings.head, self.settings.confidence
        sections: dict[str, Any] = {"drafter": self.drafter_section(directory),
                                    "correction_head": {"name": head["name"]}}
        if head["name"] != NONE:
            sections["correction_head"]["rank"] = head["rank"]
        if conf["name"] == NONE:  # no trained confidence head: every position is verified anyway
            sections["confidence"] = {"name": "constant"}
        else:
            sections["confidence"] = {"name": conf["name"], "rank": conf["rank"], "embedding": conf["embedding"]}
        return sections


class DFlashTrainConfig(BlockTrainConfig):
    """``dflash``'s training keys: the same as DSpark's, with DFlash's own defaults — 5 layers,
    γ = 16, no correction or confidence head, and its objective: the position-weighted
    cross-entropy alone, w_k = exp(−(k−1)/γ_w) with γ_w from :func:`dflash_decay`."""

    layers: int = Field(5, ge=1, description="draft transformer layers")
    gamma: int = Field(16, ge=1, description="draft positions per block")
    head: dict[str, Any] = Field(default_factory=lambda: {"name": NONE}, validate_default=True,
                                 description="correction head trained with the backbone: name + its keys, or none")
    confidence: dict[str, Any] = Field(default_factory=lambda: {"name": NONE}, validate_default=True,
                                       description="confidence head trained with it: name + its keys, or none")
    loss: LossWeights = Field(default_factory=lambda: LossWeights(ce_weight=1.0, tv_weight=0.0, conf_weight=0.0))

    @model_validator(mode="after")
    def _decay(self) -> DFlashTrainConfig:
        if self.loss.decay is None:
            self.loss = self.loss.model_copy(update={"decay": dflash_decay(self.gamma)})
        return self


class DFlashTraining(BlockTraining):
    """DFlash's layout: ``[x_0, MASK × γ]``, the γ mask slots predict x_1 … x_γ; its own
    objective and defaults (:class:`DFlashTrainConfig`)."""

    method = "dflash"
    predict_anchor = False
    config = DFlashTrainConfig
