"""The drafter trainer: any drafter registered with a training method
(:mod:`specforge.toolkit.training`), with AdamW, warmup + cosine, clipping, checkpoints and
torchrun.

One step on a global batch of ``batch.sequences`` sequences (rank r takes sequences r, r+W, …):

1. each sequence's anchors are drawn from its own seeded generator (:func:`.data.anchors_for`);
2. :func:`~specforge.features.pack_blocks` lays the blocks out as the method's
   :class:`~specforge.toolkit.training.DataNeeds` ask, over the taps of the batch's sequences
   (``ctx_index`` maps block → sequence);
3. p_t is the target's last hidden state at the teacher rows through the frozen LM head (fp32
   softmax), computed only at supervised positions;
4. the method's module runs on the :class:`~specforge.toolkit.training.TrainBatch` and its loss
   gives a :class:`~specforge.toolkit.training.LossOutput`;
5. the loss of rank r is rescaled by ``blocks_r · W / blocks_global`` so that DDP's gradient
   *mean* equals the single-process gradient of the loss averaged over all blocks, and every
   logged metric is a global sum / global count: logs match a single process up to float noise.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from specforge.features import SequenceFeatures, pack_blocks
from specforge.files import replace_atomically, write_atomic
from specforge.toolkit.losses import teacher_probs
from specforge.toolkit.training import DataSummary, DraftTraining, LossOutput, TrainBatch, empty_loss
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

__all__ = ["Trainer", "lr_at"]


def lr_at(step: int, config: TrainConfig, total: int) -> float:
    """Linear warmup from lr/warmup to lr, then cosine down to min_lr at ``total`` steps."""
    s, o = config.schedule, config.optimizer
    if step < s.warmup_steps:
        return o.lr * (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr + 0.5 * (o.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def _autocast_bf16(dtype: str, device: torch.device, target: Any) -> bool:
    """Whether the drafter's forward runs under bf16 autocast.  ``auto``: on CUDA yes; on a CPU
    what the target's measured precision runs its prompt-sized (compute-bound) passes in — bf16
    where this CPU multiplies it fastest (AMX), float32 where bf16 is emulated (AVX2: ~5x slower)
    — and float32 where the target's precision was set by hand (docs/engine.md#precision)."""
    if dtype != "auto":
        return dtype == "bfloat16"
    if device.type == "cuda":
        return True
    from specforge.runtime.torch.precision import DTYPE, PREFILL_ROWS

    plan = getattr(target, "precision", None)
    return bool(plan is not None and plan.measured and DTYPE[plan.precision_for(PREFILL_ROWS)] == torch.bfloat16)


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
            from specforge.runtime import load_target

            target = load_target(c.target)
        self.target = target
        self._build_method()
        self.source = source if source is not None else build_source(c, target, list(self.needs.layers),
                                                                      self.out_dir, self.dist, self.log)
        if list(self.source.layer_ids) != list(self.needs.layers):
            raise TrainConfigError([f"drafter: the feature source taps layers {list(self.source.layer_ids)}; "
                                    f"the drafter wants {list(self.needs.layers)}"])
        self._split_data()
        self._prepare_method()
        self._build_optimizer()
        self.step, self.epoch, self.batch_index = 0, 0, 0
        self._loss_fn = self._choose_loss(target.args.vocab_size)
        self._metric_keys = self._metric_layout()
        self._order: tuple[int, list[int]] | None = None
        self.history: list[dict[str, Any]] = []
        self.resumed_from: Path | None = None
        self.skipped: list[str] = []  # damaged checkpoints passed over by resume()

    def _build_method(self) -> None:
        """The drafter's training method (its registration's ``training=``), bound to the target."""
        c, dev = self.config, self.dist.device
        method_cls, options = c.training_method()
        self.method: DraftTraining = method_cls(options, self.target, dev)
        self.needs = self.method.needs()
        self.bf16 = _autocast_bf16(c.dtype, dev, self.target)
        self.lm_head = self.target.runtime.lm_head.to(dev)  # p_t: the target's own law, frozen

    def _prepare_method(self) -> None:
        """Tell the method about the data (``prepare``), then take its module."""
        prepare = getattr(self.method, "prepare", None)
        if callable(prepare):
            counts = self._token_counts() if self.needs.token_counts else None
            prepare(DataSummary(sequences=self.train_count, token_counts=counts))
        dev = self.dist.device
        self.module = self.method.module
        self.model: nn.Module = (DistributedDataParallel(self.module, device_ids=[dev] if dev.type == "cuda" else None)
                                 if self.dist.enabled else self.module)
        self.param_names = {id(p): n for n, p in self.module.named_parameters()}

    def _token_counts(self) -> Tensor:
        """Occurrences of each token among the supervised tokens of the training sequences, read
        group by group (a cache shard at a time), the same on every rank."""
        counts = torch.zeros(self.target.args.vocab_size, dtype=torch.long)
        held = set(self.eval_indices)
        for group in self.source.groups():
            for f in self.source.get([i for i in group if i not in held]):
                ids = f.input_ids[f.loss_mask.bool()]
                counts += torch.bincount(ids.long(), minlength=counts.numel())
        return counts

    def _build_optimizer(self) -> None:
        """AdamW with weight decay on matrices only."""
        o, dev = self.config.optimizer, self.dist.device
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=o.lr, betas=o.betas, eps=o.eps,
                                           # one fused kernel per tensor: ~4× faster than the
                                           # foreach path over the V×r head tables on a CPU
                                           fused=dev.type in ("cpu", "cuda"))

    def _split_data(self) -> None:
        """The last ``data.eval_sequences`` sequences are held out; the rest is shuffled per epoch."""
        c = self.config
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

    # -- helpers --------------------------------------------------------------------------------

    def _choose_loss(self, vocab: int) -> Callable[[Any, TrainBatch], LossOutput]:
        """The method's loss, compiled when that pays: a loss over ``[blocks, γ, V]`` tensors makes
        many elementwise passes, which inductor fuses into a few; with a small vocabulary compiling
        costs more than it saves.  A compiler failure falls back to eager, with a message."""
        eager = self.method.loss
        wanted = self.config.compile
        if wanted is False or (wanted is None and vocab < 8192):
            return eager
        compiled = torch.compile(eager, dynamic=True)

        def loss(outputs: Any, batch: TrainBatch) -> LossOutput:
            nonlocal compiled
            try:
                return compiled(outputs, batch)
            except Exception as exc:  # noqa: BLE001 - any backend error: train on, eagerly
                if compiled is eager:
                    raise
                self.log(f"torch.compile of the loss failed ({type(exc).__name__}: {exc}); using eager")
                compiled = eager
                return eager(outputs, batch)

        return loss

    def _metric_layout(self) -> list[tuple[str, str]]:
        """(kind, name) of every entry of the flat metric vector the ranks all-reduce."""
        m = self.method.metrics
        return [("mean", k) for k in m.means] + [("sum", k) for k in m.sums] + [("pos", k) for k in m.positions]

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

    def _inputs(self, feats: Sequence[SequenceFeatures], anchors: list[Tensor]) -> TrainBatch | None:
        dev, needs = self.dist.device, self.needs
        gamma = needs.block
        packed = pack_blocks(feats, gamma, anchors=anchors, mask_token_id=needs.mask_token_id)
        b = packed.num_blocks
        if b == 0:
            return None
        ctx = nn.utils.rnn.pad_sequence([f.taps.flatten(1) for f in feats], batch_first=True)
        lengths = torch.tensor([len(f) for f in feats])
        ctx_valid = torch.arange(ctx.shape[1])[None] < lengths[:, None]
        grid = lambda t: t.view(b, gamma).to(dev)  # noqa: E731 - trim=False: every block has γ slots
        valid = grid(packed.valid)
        anchor_ids = grid(packed.input_ids)[:, 0]
        block_ids = torch.full((b, needs.slots), needs.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = anchor_ids
        p_t = None
        if needs.teacher:  # only at supervised positions (the rest never enters the loss)
            rows = grid(packed.teacher_rows)
            hidden = torch.cat([f.hidden for f in feats])
            p_t = torch.zeros(b, gamma, self.lm_head.shape[0], device=dev)
            if valid.any():
                with torch.no_grad():
                    p_t[valid] = teacher_probs(hidden.to(dev)[rows[valid]], self.lm_head)
        return TrainBatch(block_ids=block_ids, anchor_pos=packed.block_anchor.to(dev), anchor_ids=anchor_ids,
                          labels=grid(packed.labels), prev_ids=grid(packed.prev_ids), valid=valid, ctx=ctx.to(dev),
                          ctx_valid=ctx_valid.to(dev), ctx_index=packed.block_seq.to(dev), p_t=p_t,
                          ctx_ids=nn.utils.rnn.pad_sequence([f.input_ids for f in feats], batch_first=True).to(dev))

    @contextlib.contextmanager
    def forward_context(self, train: bool) -> Iterator[None]:
        """How the drafter's forward runs: gradients when ``train``, bfloat16 autocast where chosen."""
        amp = torch.autocast(self.dist.device.type, dtype=torch.bfloat16, enabled=self.bf16)
        with torch.set_grad_enabled(train), amp, warnings.catch_warnings():
            # Under autocast RMSNorm gets bf16 activations and fp32 weights: correct, just unfused.
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            yield

    def _loss(self, indices: Sequence[int], epoch: int, train: bool) -> dict[str, float]:
        """Forward (and backward when ``train``) on this rank's share of ``indices``; global metrics."""
        c, dist = self.config, self.dist
        mine = list(indices)[dist.rank::dist.world]
        feats = self.source.get(mine) if mine else []
        batch = self._inputs(feats, anchors_for(feats, c.batch.anchors, c.seed, epoch)) if feats else None
        with self.forward_context(train):
            out = self.model(batch)
        if batch is None:
            loss_local, res = out, empty_loss(self.method.metrics, self.needs.block, dist.device)
        else:
            res = self._loss_fn(out, batch)
            loss_local = res.total * res.blocks
        # One flat float64 vector: Σ loss·blocks, blocks, tokens, each mean·blocks, each sum, then
        # each per-slot sum and count; its all-reduce gives every metric as global sum / count.
        blocks = res.blocks.float()
        parts = [res.total * blocks, blocks, torch.tensor(float(sum(len(f) for f in feats)), device=blocks.device)]
        parts += [res.means[k] * blocks for kind, k in self._metric_keys if kind == "mean"]
        parts += [res.sums[k] for kind, k in self._metric_keys if kind == "sum"]
        flat = [torch.stack([t.float() for t in parts])]
        flat += [t for kind, k in self._metric_keys if kind == "pos" for t in res.positions[k]]
        local = torch.cat([t.detach().double().cpu().reshape(-1) for t in flat])
        sums = dist.all_reduce_sum(local.to(dist.device)).cpu()
        blocks_global = max(1.0, float(sums[1]))
        if train:
            # Σ_blocks loss / global blocks, times W because DDP averages the ranks' gradients.
            (loss_local * (dist.world / blocks_global)).backward()
        out_m: dict[str, Any] = {"loss": float(sums[0]) / blocks_global}
        i = 3
        for kind, k in self._metric_keys:
            if kind == "mean":
                out_m[k] = float(sums[i]) / blocks_global
                i += 1
        out_m.update({"blocks": int(sums[1]), "tokens": int(sums[2])})
        for kind, k in self._metric_keys:
            if kind == "sum":
                out_m[k] = int(sums[i]) if float(sums[i]).is_integer() else float(sums[i])
                i += 1
        gamma = self.needs.block
        for kind, k in self._metric_keys:
            if kind == "pos":
                rate = sums[i:i + gamma] / sums[i + gamma:i + 2 * gamma].clamp_min(1)
                out_m.update({f"{k}@{j + 1}": float(v) for j, v in enumerate(rate)})
                i += 2 * gamma
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
                "grad_norm": grad_norm, "tokens_per_s": metrics["tokens"] / dt, "step_time": dt,
                "threads": torch.get_num_threads()}

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

        if c.batch.memory_check and self.step < self.total_steps:
            from specforge.training.memory import check_step_memory

            memory = check_step_memory(self)  # a step that would not fit: refused here, not killed later
            if memory is not None:
                self.log(memory.summary())
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
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec.get('tau', float('nan')):.2f}",
                                lr=f"{rec['lr']:.1e}")
                if c.output.eval_interval and self.step % c.output.eval_interval == 0:
                    ev = self.evaluate()
                    if ev is not None:
                        self._record(ev)
                        self._plot_curve()
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

    def _plot_curve(self) -> None:
        """``learning-curve.png`` beside metrics.jsonl, redrawn at every evaluation."""
        if self.dist.is_main:
            from specforge.training.curve import learning_curve, plot_learning_curve

            plot_learning_curve(learning_curve(self.history), self.out_dir / "learning-curve.png",
                                title=f"{self.config.drafter.name} on {self.config.target.model}")

    # -- checkpoints ----------------------------------------------------------------------------

    def _write_drafter(self, directory: Path) -> None:
        # Provenance travels with the weights: the model card of `specforge export --to hf` names the data.
        self.method.save(directory, {"target": self.config.target.model, "trained_steps": self.step,
                                     "data": self.config.to_dict().get("data")})

    def export(self, directory: Path) -> Path:
        """The trained drafter alone (for eval and inference), replaced atomically."""
        with replace_atomically(directory) as tmp:
            self._write_drafter(tmp)
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
        self.method.load(ckpt.drafter_dir)
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
        write_atomic(path, "".join(line + "\n" for line in kept))

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
