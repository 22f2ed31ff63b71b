"""The DSpark drafter trainer (SPEC §7.5): packed anchors → backbone → correction head →
confidence head → DSpark loss, with AdamW, warmup + cosine, clipping, checkpoints and torchrun.

One step on a global batch of ``batch.sequences`` sequences (rank r takes sequences r, r+W, …):

1. each sequence's anchors are drawn from its own seeded generator (:func:`.data.anchors_for`);
2. :func:`~specforge.features.pack_blocks` lays the blocks out; the backbone drafts them all in
   one pass over the fused taps of the batch's sequences (``ctx_index`` maps block → sequence);
3. the correction head runs teacher-forced on the true previous tokens, the confidence head on
   the same inputs;
4. p_t is the target's last hidden state at the teacher rows through the frozen LM head (fp32
   softmax), computed only at supervised positions;
5. the loss of rank r is rescaled by ``blocks_r · W / blocks_global`` so that DDP's gradient
   *mean* equals the single-process gradient of the loss averaged over all blocks, and every
   logged metric is a global sum / global count: logs match a single process up to float noise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from specforge.features import SequenceFeatures, pack_blocks
from specforge.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    latest_checkpoint,
    optimizer_from_tensors,
    optimizer_to_tensors,
    prune_checkpoints,
    read_checkpoint,
    rng_restore,
    write_checkpoint,
)
from specforge.training.config import TrainConfig, TrainConfigError
from specforge.training.data import FeatureSource, anchors_for, build_source, epoch_order
from specforge.training.distributed import DistContext, init_distributed
from specforge.training.losses import dspark_loss, teacher_probs
from specforge_plugins.confidence import DSparkConfidence
from specforge_plugins.drafters.block import MASK, BlockBackbone, BlockDrafterConfig, SharedWeights
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter
from specforge_plugins.heads import HEADS

__all__ = ["DrafterModule", "Trainer", "lr_at"]


def lr_at(step: int, config: TrainConfig, total: int) -> float:
    """Linear warmup from lr/warmup to lr, then cosine down to min_lr at ``total`` steps."""
    s, o = config.schedule, config.optimizer
    if step < s.warmup_steps:
        return o.lr * (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr + 0.5 * (o.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


class DrafterModule(nn.Module):
    """The trainable drafter as one module, so DDP wraps (and all-reduces) all of it at once."""

    def __init__(self, backbone: BlockBackbone, head: nn.Module | None, confidence: nn.Module | None) -> None:
        super().__init__()
        self.backbone, self.head, self.confidence = backbone, head, confidence

    def forward(self, batch: dict[str, Tensor] | None) -> tuple[Tensor, Tensor | None] | Tensor:
        if batch is None:
            # A rank whose sequences gave no block still joins the gradient all-reduce (zeros).
            return sum(p.sum() for p in self.parameters()) * 0.0
        hidden, logits = self.backbone(batch["block_ids"], batch["ctx"], batch["anchor_pos"],
                                       ctx_valid=batch["ctx_valid"], ctx_index=batch["ctx_index"])
        if self.head is not None:
            logits = self.head.forward_train(logits, batch["prev_ids"], hidden)
        conf = None if self.confidence is None else self.confidence.logits(hidden, batch["prev_ids"])
        return logits, conf


class Trainer:
    """Build from a :class:`TrainConfig` (plus, optionally, a ready target and feature source)."""

    def __init__(self, config: TrainConfig, *, target: Any = None, source: FeatureSource | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.config = c = config
        self.dist: DistContext = init_distributed(c.device)
        self.out_dir = Path(c.output.dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if target is None:
            from specforge.target import TargetModel
            target = TargetModel.load(c.target.model, c.target.dtype)
        self.target = target
        d = c.drafter
        self.block_config = BlockDrafterConfig.from_model_args(
            target.args, draft_layers=d.layers, gamma=d.gamma,
            target_layers=tuple(d.target_layers) if d.target_layers is not None else None)
        layer_ids = list(self.block_config.tap_layers)
        self.source = source if source is not None else build_source(c, target, layer_ids, self.out_dir, self.dist,
                                                                      self.log)
        if list(self.source.layer_ids) != layer_ids:
            raise TrainConfigError([f"drafter.target_layers: the feature source taps layers "
                                    f"{list(self.source.layer_ids)}; the drafter wants {layer_ids}"])

        dev = self.dist.device
        self.bf16 = c.dtype == "bfloat16" or (c.dtype == "auto" and dev.type == "cuda")
        rt = target.runtime
        self.shared = SharedWeights.from_target(rt)
        if dev.type != "cpu":  # the drafter reads the target's frozen tensors on its own device
            self.shared = SharedWeights(rt.embed.to(dev), rt.lm_head.to(dev), self.shared.embed_scale,
                                        None if rt.inv_freq is None else rt.inv_freq.to(dev), self.shared.rope_scaling)
        backbone = BlockBackbone(self.block_config, self.shared, seed=d.seed)
        if d.norm_init_scale is not None:  # the frozen LM head was trained on the target's norm's scale
            with torch.no_grad():
                backbone.norm.weight.copy_(d.norm_init_scale * rt.norm.detach().float())
        head = None if d.head.name == "none" else HEADS[d.head.name](d.head.head_config())
        confidence = None if d.confidence.name == "none" else DSparkConfidence(d.confidence.head_config())
        for m in (head, confidence):
            if m is not None:
                m.bind(target)
        if confidence is not None and confidence.config.embedding == "head":
            confidence.tie(head)
        self.module = DrafterModule(backbone, head, confidence).to(dev)
        self.model: nn.Module = (DistributedDataParallel(self.module, device_ids=[dev] if dev.type == "cuda" else None)
                                 if self.dist.enabled else self.module)
        self.param_names = {id(p): n for n, p in self.module.named_parameters()}
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        o = c.optimizer
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=o.lr, betas=o.betas, eps=o.eps,
                                           # one fused kernel per tensor: ~4× faster than the
                                           # foreach path over the V×r head tables on a CPU
                                           fused=dev.type in ("cpu", "cuda"))

        # Data: the last eval_sequences sequences are held out; the rest is shuffled per epoch.
        n = len(self.source)
        held = min(c.data.eval_sequences, max(0, n - 1))
        self.eval_indices = list(range(n - held, n))
        self.train_count = n - held
        self.steps_per_epoch = self.train_count // c.batch.sequences
        if self.steps_per_epoch == 0:
            raise TrainConfigError([f"batch.sequences: {c.batch.sequences} is more than the {self.train_count} "
                                    "training sequences the data gave (raise data.limit or lower batch.sequences)"])
        if c.batch.sequences < self.dist.world:
            raise TrainConfigError([f"batch.sequences: {c.batch.sequences} leaves some of the {self.dist.world} "
                                    "ranks idle"])
        s = c.schedule
        self.total_steps = s.total_steps or max(1, round(s.epochs * self.steps_per_epoch))
        self.step, self.epoch, self.batch_index = 0, 0, 0
        self._loss_fn = self._choose_loss(target.args.vocab_size)
        self._order: tuple[int, list[int]] | None = None
        self.history: list[dict[str, Any]] = []
        self.resumed_from: Path | None = None
        self.skipped: list[str] = []  # damaged checkpoints passed over by resume()

    # -- helpers --------------------------------------------------------------------------------

    def _choose_loss(self, vocab: int) -> Callable[..., Any]:
        """The loss, compiled when that pays: it makes ~10 elementwise passes over [blocks, γ, V]
        tensors, which inductor fuses into a few; with a small vocabulary compiling costs more
        than it saves.  A compiler failure falls back to eager, with a message."""
        wanted = self.config.compile
        if wanted is False or (wanted is None and vocab < 8192):
            return dspark_loss
        compiled = torch.compile(dspark_loss, dynamic=True)

        def loss(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            try:
                return compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any backend error: train on, eagerly
                if compiled is dspark_loss:
                    raise
                self.log(f"torch.compile of the loss failed ({type(exc).__name__}: {exc}); using eager")
                compiled = dspark_loss
                return dspark_loss(*args, **kwargs)

        return loss

    def log(self, msg: str) -> None:
        if self.dist.is_main:
            self._log(msg)

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.source.groups(), self.config.seed, epoch,
                                              self.config.features.shuffle_window, set(self.eval_indices)))
        return self._order[1]

    def global_batch(self, epoch: int, index: int) -> list[int]:
        b = self.config.batch.sequences
        return self._epoch_order(epoch)[index * b:(index + 1) * b]

    def _inputs(self, feats: Sequence[SequenceFeatures], anchors: list[Tensor]) -> dict[str, Tensor] | None:
        dev = self.dist.device
        gamma = self.block_config.gamma
        mask_id = MASK if self.block_config.mask_token_id is None else self.block_config.mask_token_id
        packed = pack_blocks(feats, gamma, anchors=anchors, mask_token_id=mask_id)
        b = packed.num_blocks
        if b == 0:
            return None
        ctx = nn.utils.rnn.pad_sequence([f.taps.flatten(1) for f in feats], batch_first=True)
        lengths = torch.tensor([len(f) for f in feats])
        ctx_valid = torch.arange(ctx.shape[1])[None] < lengths[:, None]
        hidden = torch.cat([f.hidden for f in feats])
        grid = lambda t: t.view(b, gamma).to(dev)  # noqa: E731 - trim=False: every block has γ slots
        valid = grid(packed.valid)
        rows = grid(packed.teacher_rows)
        # p_t only at supervised positions (the rest never enters the loss).
        p_t = torch.zeros(b, gamma, self.shared.lm_head.shape[0], device=dev)
        if valid.any():
            with torch.no_grad():
                p_t[valid] = teacher_probs(hidden.to(dev)[rows[valid]], self.shared.lm_head)
        return {"block_ids": grid(packed.input_ids), "ctx": ctx.to(dev), "anchor_pos": packed.block_anchor.to(dev),
                "ctx_valid": ctx_valid.to(dev), "ctx_index": packed.block_seq.to(dev),
                "prev_ids": grid(packed.prev_ids), "labels": grid(packed.labels), "valid": valid, "p_t": p_t}

    def _loss(self, indices: Sequence[int], epoch: int, train: bool) -> dict[str, float]:
        """Forward (and backward when ``train``) on this rank's share of ``indices``; global metrics."""
        c, dist = self.config, self.dist
        mine = list(indices)[dist.rank::dist.world]
        feats = self.source.get(mine) if mine else []
        inputs = self._inputs(feats, anchors_for(feats, c.batch.anchors, c.seed, epoch)) if feats else None
        gamma = self.block_config.gamma
        amp = torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with torch.set_grad_enabled(train), amp, warnings.catch_warnings():
            # Under autocast RMSNorm gets bf16 activations and fp32 weights: correct, just unfused.
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            out = self.model(inputs)
        if inputs is None:
            loss_local, local = out, torch.zeros(8 + 2 * gamma, dtype=torch.float64)
        else:
            logits, conf = out
            res = self._loss_fn(logits, inputs["labels"], inputs["p_t"], inputs["valid"], conf, gamma=gamma,
                              ce_weight=c.loss.ce_weight, tv_weight=c.loss.tv_weight, conf_weight=c.loss.conf_weight)
            blocks = res.mask[:, 0].sum()
            loss_local = res.total * blocks
            local = torch.cat([torch.stack([res.total * blocks, res.ce * blocks, res.tv * blocks, res.conf * blocks,
                                            res.tau * blocks, blocks.float(),
                                            torch.tensor(float(sum(len(f) for f in feats))),
                                            res.mask.sum().float()]).detach().double().cpu(),
                               res.c_star.sum(0).detach().double().cpu(), res.mask.sum(0).double().cpu()])
        sums = dist.all_reduce_sum(local.to(dist.device)).cpu()
        blocks_global = max(1.0, float(sums[5]))
        if train:
            # Σ_blocks loss / global blocks, times W because DDP averages the ranks' gradients.
            (loss_local * (dist.world / blocks_global)).backward()
        acc = sums[8:8 + gamma] / sums[8 + gamma:].clamp_min(1)
        out_m = {"loss": float(sums[0]) / blocks_global, "ce": float(sums[1]) / blocks_global,
                 "tv": float(sums[2]) / blocks_global, "conf": float(sums[3]) / blocks_global,
                 "tau": float(sums[4]) / blocks_global, "blocks": int(sums[5]), "tokens": int(sums[6]),
                 "supervised": int(sums[7])}
        out_m.update({f"accept_rate@{k + 1}": float(v) for k, v in enumerate(acc)})
        return out_m

    # -- the loop -------------------------------------------------------------------------------

    def train_step(self) -> dict[str, Any]:
        c = self.config
        t0 = time.perf_counter()
        lr = lr_at(self.step, c, self.total_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.module.train()
        epoch = self.epoch
        metrics = self._loss(self.global_batch(epoch, self.batch_index), epoch, train=True)
        if not math.isfinite(metrics["loss"]):
            # Stop before the optimizer spreads it; the checkpoints so far are intact.
            raise FloatingPointError(f"step {self.step + 1}: the loss is {metrics['loss']}; resume from the last "
                                     f"checkpoint with a lower optimizer.lr or a tighter grad_clip")
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = c.grad_clip if c.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.step += 1
        self.batch_index += 1
        if self.batch_index >= self.steps_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        dt = time.perf_counter() - t0
        return {"split": "train", "step": self.step, "epoch": epoch, "lr": lr, **metrics,
                "grad_norm": grad_norm, "tokens_per_s": metrics["tokens"] / dt, "step_time": dt}

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """The loss terms, accept_rate@k and τ̂ on the held-out sequences (fixed anchors)."""
        if not self.eval_indices:
            return None
        self.module.eval()
        b = self.config.batch.sequences
        parts = [self._loss(self.eval_indices[i:i + b], -1, train=False) for i in range(0, len(self.eval_indices), b)]
        blocks = sum(p["blocks"] for p in parts) or 1
        out = {k: sum(p[k] * p["blocks"] for p in parts) / blocks for k in parts[0] if k not in ("blocks", "tokens", "supervised")}
        return {"split": "eval", "step": self.step, **out, "blocks": blocks}

    def train(self, max_steps: int | None = None) -> list[dict[str, Any]]:
        """Train to ``total_steps`` (checkpoint every ``checkpoint_interval`` and at the end).
        ``max_steps`` stops after that many steps *without* a final checkpoint, as a kill would."""
        c = self.config
        from tqdm.auto import tqdm

        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", desc="train", dynamic_ncols=True,
                   disable=not (c.output.progress and self.dist.is_main))
        done = 0
        try:
            while self.step < self.total_steps and (max_steps is None or done < max_steps):
                rec = self.train_step()
                done += 1
                if self.step % c.output.log_interval == 0 or self.step == self.total_steps:
                    self._record(rec)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['tau']:.2f}", lr=f"{rec['lr']:.1e}")
                if c.output.eval_interval and self.step % c.output.eval_interval == 0:
                    ev = self.evaluate()
                    if ev is not None:
                        self._record(ev)
                if self.step % c.output.checkpoint_interval == 0 or self.step == self.total_steps:
                    self.save_checkpoint()
        finally:
            bar.close()
        if self.step == self.total_steps and self.dist.is_main:
            self.export(self.out_dir / "drafter")
        return self.history

    def _record(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

    # -- checkpoints ----------------------------------------------------------------------------

    def _drafter_meta(self) -> dict[str, Any]:
        return {"kind": "dspark", "gamma": self.block_config.gamma, "target": self.config.target.model,
                "trained_steps": self.step}

    def _write_drafter(self, directory: Path) -> None:
        m = self.module
        save_drafter(directory, m.backbone, m.head, m.confidence, self._drafter_meta())

    def export(self, directory: Path) -> Path:
        """The trained drafter alone (for eval and inference), replaced atomically."""
        tmp = directory.with_name(f".{directory.name}.tmp{os.getpid()}")
        self._write_drafter(tmp)
        old = directory.with_name(f".{directory.name}.old{os.getpid()}")
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        if old.exists():
            import shutil
            shutil.rmtree(old)
        return directory

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the checkpoint of the current step; every rank waits for it."""
        path = None
        if self.dist.is_main:
            tensors, opt_meta = optimizer_to_tensors(self.optimizer, self.param_names)
            state = {"epoch": self.epoch, "batch": self.batch_index, "seed": self.config.seed,
                     "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                     "world_size": self.dist.world, "optimizer": opt_meta,
                     "metrics": self.history[-1] if self.history else None}
            path = write_checkpoint(self.ckpt_dir, self.step, self._write_drafter, tensors, state,
                                    self.config.to_dict())
            prune_checkpoints(self.ckpt_dir, self.config.output.keep_checkpoints)
        self.dist.barrier()
        return path

    def load_state(self, ckpt: Checkpoint) -> None:
        backbone, head, confidence, _ = load_drafter(ckpt.drafter_dir)
        m = self.module
        for mine, loaded, name in ((m.backbone, backbone, "backbone"), (m.head, head, "head"),
                                   (m.confidence, confidence, "confidence")):
            if (mine is None) != (loaded is None):
                raise CheckpointError(f"{ckpt.path}: the checkpoint's {name} does not match the config")
            if mine is not None:
                mine.load_state_dict(loaded.state_dict())
        optimizer_from_tensors(self.optimizer, self.param_names, ckpt.optimizer, ckpt.state["optimizer"])
        rng_restore(ckpt.rng, ckpt.state["rng"])
        st = ckpt.state
        if st["steps_per_epoch"] != self.steps_per_epoch:
            raise CheckpointError(f"{ckpt.path}: written with {st['steps_per_epoch']} steps per epoch, the data "
                                  f"now gives {self.steps_per_epoch}; resume with the same data and batch size")
        self.step, self.epoch, self.batch_index = ckpt.step, st["epoch"], st["batch"]
        self._truncate_metrics()

    def _truncate_metrics(self) -> None:
        """Drop log lines of steps after the checkpoint (a killed run logged them, they are redone)."""
        path = self.out_dir / "metrics.jsonl"
        if not self.dist.is_main or not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= self.step]
        self.history = [json.loads(line) for line in kept]
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)

    @classmethod
    def resume(cls, directory: str | Path, config: TrainConfig | None = None, **kwargs: Any) -> Trainer:
        """Continue the run in ``directory`` (its ``output.dir``) from its newest complete checkpoint.

        ``config`` defaults to the checkpoint's own; damaged newer checkpoints are reported and skipped.
        """
        directory = Path(directory)
        path, skipped = latest_checkpoint(directory / "checkpoints")
        log = kwargs.get("log") or (lambda msg: print(msg, file=sys.stderr, flush=True))
        for line in skipped:
            log(line)
        if path is None:
            raise CheckpointError(f"no complete checkpoint under {directory / 'checkpoints'}"
                                  + (f" ({'; '.join(skipped)})" if skipped else ""))
        ckpt = read_checkpoint(path)
        if config is None:
            config = TrainConfig.model_validate(ckpt.config)
        config = config.model_copy(update={"output": config.output.model_copy(update={"dir": str(directory)})})
        trainer = cls(config, **kwargs)
        trainer.load_state(ckpt)
        trainer.resumed_from, trainer.skipped = path, skipped
        trainer.log(f"resumed from {path} (step {trainer.step} of {trainer.total_steps})")
        return trainer

    def state_dict(self) -> dict[str, Tensor]:
        """The trainable parameters by name (for comparing runs)."""
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def close(self) -> None:
        self.dist.close()
