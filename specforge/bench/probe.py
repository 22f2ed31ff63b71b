"""``specforge bench probe``: how much of the next few tokens a drafter's inputs hold (docs/comparison.md#ceiling).

A block drafter anchored at position a reads the target's tapped layers at positions < a and the
anchor token x_a, and its slot j predicts x_{a+1+j}.  This bench fits, on a feature cache, the
simplest read-out of the last of those inputs: for each offset k = 1 … K a *probe*

    p_k(· | t) = softmax( LM head_N( RMSNorm( W_k [H(l1);…;H(lm)]_t ; emb(x_{t+1}) ) ) )

— the fused taps of position t = a − 1 and the anchor's embedding, one linear map to the model
width, then the target's own frozen final norm scale and LM head over the draft vocabulary —
predicting x_{t+1+k}, i.e. what slot k − 1 of a block predicts.  Beside it, the same probe over
the anchor embedding alone (what a Markov head knows) and the trained drafter's own
``accept_rate@k`` if one is named.  Reported on held-out sequences: top-1 agreement with the
token (greedy acceptance on this data) and 1 − TV against the target's law of that token
(acceptance at T = 1), per offset.

What it bounds: a probe reads one position linearly; a drafter also attends over every earlier
position and has a few layers, so it can do better.  A drafter far *below* the probe at slot 1
under-uses its inputs (a recipe or input defect); a probe near zero at k = 1 says the features do
not carry the token two ahead, whatever reads them.

Outputs: ``probe.json``, a table and ``probe.png`` (agreement per offset, each probe a line).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specforge.bench.runner import Report, add_output_arguments, bench_command
from specforge.machine import machine

__all__ = ["COMMAND", "REPORT", "ProbeData", "fit_probe", "probe_rows", "replayable_drafter", "run_probe", "table"]


class ProbeData:
    """Rows of one split: fused-tap inputs ``x [n, m·d]``, anchor ids ``anchor [n]``, and per
    offset k the label ``y[:, k-1]`` (−1 where the label is not supervised) and the target's
    final hidden state that gives its law (``teacher [n, K, d]``)."""

    def __init__(self, x: Tensor, anchor: Tensor, y: Tensor, teacher: Tensor) -> None:
        self.x, self.anchor, self.y, self.teacher = x, anchor, y, teacher

    def __len__(self) -> int:
        return int(self.x.shape[0])


def probe_rows(features: list[Any], offsets: int, max_rows: int | None, seed: int) -> ProbeData:
    """Every position t whose anchor t + 1 and first label t + 2 lie in the loss mask (a block's
    first slot is supervised), as in training; a later offset keeps its label only while the
    labels before it are supervised too (the contiguous valid prefix)."""
    xs, anchors, ys, teachers = [], [], [], []
    for f in features:
        n, mask = len(f), f.loss_mask.bool()
        t = torch.arange(max(0, n - 2))
        t = t[mask[t + 1] & mask[t + 2]]
        if len(t) == 0:
            continue
        label_pos = t[:, None] + 1 + torch.arange(1, offsets + 1)[None]  # [rows, K]
        inside = label_pos < n
        ok = torch.cumprod((inside & mask[label_pos.clamp(max=n - 1)]).long(), 1).bool()
        xs.append(f.taps[t].flatten(1))
        anchors.append(f.input_ids[t + 1])
        ys.append(torch.where(ok, f.input_ids[label_pos.clamp(max=n - 1)], -1))
        teachers.append(f.hidden[(label_pos - 1).clamp(max=n - 1)])
    data = ProbeData(torch.cat(xs), torch.cat(anchors), torch.cat(ys), torch.cat(teachers))
    if max_rows is not None and len(data) > max_rows:
        keep = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:max_rows]
        data = ProbeData(data.x[keep], data.anchor[keep], data.y[keep], data.teacher[keep])
    return data


class _Probe(nn.Module):
    """One linear map per offset into the model width, read out by the target's frozen final-norm
    scale and LM head over the draft vocabulary."""

    def __init__(self, in_dim: int, dim: int, offsets: int, norm: Tensor, head: Tensor, eps: float) -> None:
        super().__init__()
        self.maps = nn.ModuleList(nn.Linear(in_dim, dim, bias=False) for _ in range(offsets))
        for m in self.maps:
            nn.init.normal_(m.weight, std=in_dim ** -0.5)
        self.register_buffer("norm", norm.float())
        self.register_buffer("head", head.float())
        self.eps = eps

    def forward(self, x: Tensor, k: int) -> Tensor:
        h = F.rms_norm(self.maps[k](x), (self.norm.shape[0],), self.norm, self.eps)
        return F.linear(h, self.head)


def _inputs(data: ProbeData, embed: Tensor, use_taps: bool) -> Tensor:
    e = embed[data.anchor].float()
    return torch.cat([data.x.float(), e], dim=1) if use_taps else e


def fit_probe(train: ProbeData, test: ProbeData, embed: Tensor, runtime: Any, vocab_ids: Tensor, use_taps: bool,
              epochs: int, batch: int, lr: float, seed: int, progress: bool = True) -> dict[str, list[float]]:
    """Train the probes on ``train``; top-1 agreement and 1 − TV per offset on ``test``."""
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    offsets = train.y.shape[1]
    x_train, x_test = _inputs(train, embed, use_taps), _inputs(test, embed, use_taps)
    head = runtime.lm_head.detach()[vocab_ids]
    norm = runtime.norm.detach().float() + runtime.args.norm_offset  # Gemma stores w and scales by 1 + w
    probe = _Probe(x_train.shape[1], runtime.args.dim, offsets, norm, head, runtime.args.norm_eps)
    to_draft = torch.full((runtime.args.vocab_size,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    opt = torch.optim.AdamW(probe.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(train) / batch) * offsets
    bar = tqdm(total=steps, desc=f"probe ({'taps + anchor' if use_taps else 'anchor only'})", disable=not progress)
    for _ in range(epochs):
        order = torch.randperm(len(train))
        for k in range(offsets):
            for start in range(0, len(train), batch):
                idx = order[start:start + batch]
                labels = to_draft[train.y[idx, k].clamp_min(0)].masked_fill(train.y[idx, k] < 0, -1)
                if (labels >= 0).any():
                    loss = F.cross_entropy(probe(x_train[idx], k), labels, ignore_index=-1)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                bar.update(1)
    bar.close()
    agree, accept = [], []
    with torch.no_grad():
        full_head = runtime.lm_head.detach().float()
        for k in range(offsets):
            rows = test.y[:, k] >= 0
            logits = probe(x_test[rows], k)
            pred = vocab_ids[logits.argmax(-1)]
            agree.append(float((pred == test.y[rows, k]).float().mean()) if rows.any() else float("nan"))
            p_t = torch.softmax(F.linear(test.teacher[rows, k].float(), full_head), -1)
            q = torch.zeros_like(p_t)
            q[:, vocab_ids] = torch.softmax(logits, -1)
            accept.append(float((1 - 0.5 * (q - p_t).abs().sum(-1)).mean()) if rows.any() else float("nan"))
    return {"top1": agree, "accept_t1": accept}


def run_probe(features_dir: str | Path, offsets: int = 4, vocab: int = 8192, held_out: int = 32,
              max_rows: int | None = 60000, epochs: int = 2, batch: int = 256, lr: float = 1e-3, seed: int = 0,
              drafter: str | None = None, progress: bool = True) -> dict[str, Any]:
    from specforge.features import FeatureCache
    from specforge.runtime import load_target
    from specforge.vocab import DraftVocab

    cache = FeatureCache(features_dir)
    target = load_target(cache.manifest.target_name, dtype="float32", backend="torch")  # replays on the teacher
    cache = FeatureCache(features_dir, target)  # the cache is the target's own
    feats = list(cache)
    if len(feats) <= held_out:
        raise ValueError(f"{features_dir}: {len(feats)} sequences; the probe holds out {held_out} (lower --held-out)")
    train_f, test_f = feats[:-held_out], feats[-held_out:]
    counts = torch.zeros(target.args.vocab_size, dtype=torch.long)
    for f in train_f:
        counts += torch.bincount(f.input_ids[f.loss_mask.bool()], minlength=counts.numel())
    vocab_ids = DraftVocab.most_frequent(counts, min(vocab, target.args.vocab_size)).ids
    train, test = probe_rows(train_f, offsets, max_rows, seed), probe_rows(test_f, offsets, None, seed)
    embed = target.runtime.embed.detach()
    result: dict[str, Any] = {
        "machine": machine(), "features": str(features_dir), "layers": cache.layer_ids, "offsets": offsets,
        "vocab": len(vocab_ids), "rows": {"train": len(train), "test": len(test)}, "probes": {}}
    if epochs > 0:  # 0: only the drafter's replay
        result["probes"] = {
            "taps + anchor": fit_probe(train, test, embed, target.runtime, vocab_ids, True, epochs, batch, lr, seed,
                                       progress),
            "anchor only": fit_probe(train, test, embed, target.runtime, vocab_ids, False, epochs, batch, lr, seed,
                                     progress),
        }
    if drafter is not None:
        replaying = replayable_drafter(drafter, target)
        result["drafter"] = {"held_out": replaying.replay(test_f, target),
                             "trained_on": replaying.replay(train_f[:held_out], target)}
    return result


def replayable_drafter(checkpoint: str, target: Any) -> Any:
    """The drafter that serves ``checkpoint`` (by the method its config records), in float32 as
    trained, bound to ``target``; a drafter without the ``Replays`` protocol is an error."""
    from specforge.plugins import get_host
    from specforge.protocols import Replays
    from specforge.toolkit.checkpoints import checkpoint_method

    method = checkpoint_method(checkpoint)
    drafter = get_host().create_drafter(method, {"checkpoint": checkpoint, "dtype": "float32"})
    if not isinstance(drafter, Replays):
        raise ValueError(f"{checkpoint}: the {method} drafter cannot replay its rounds on cached features (it has "
                         "no replay(features, target)); --drafter takes a dspark, dflash or eagle3 checkpoint")
    drafter.bind(target)
    return drafter


def table(result: dict[str, Any]) -> str:
    from specforge.evaluation.report import fmt

    k = result["offsets"]
    lines = [f"**Probes** on {result['features']} (layers {result['layers']}, draft vocabulary {result['vocab']}; "
             f"{result['rows']['train']} training rows, {result['rows']['test']} held out) — slot k predicts "
             f"x_(a+k) from the taps before the anchor a and x_a", "",
             "| probe | measure | " + " | ".join(f"slot {i}" for i in range(1, k + 1)) + " |",
             "|---|---|" + "---|" * k]
    for name, p in result["probes"].items():
        lines.append(f"| {name} | top-1 agreement | " + " | ".join(fmt(v) for v in p["top1"]) + " |")
        lines.append(f"| {name} | 1 − TV (T = 1) | " + " | ".join(fmt(v) for v in p["accept_t1"]) + " |")
    if "drafter" in result:
        for split, d in result["drafter"].items():
            lines.append(f"| drafter, {split.replace('_', ' ')} (replayed τ {fmt(d['replay_tau'])}) | top-1 agreement | "
                         + " | ".join(fmt(v) for v in d["top1"][:k]) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    from specforge.plots import new_figure, save_figure

    fig = new_figure(9, 4)
    slots = list(range(1, result["offsets"] + 1))
    for i, (measure, label) in enumerate((("top1", "top-1 agreement (greedy)"), ("accept_t1", "1 − TV (T = 1)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for name, p in result["probes"].items():
            ax.plot(slots, p[measure], marker="o", label=name)
        if measure == "top1" and "drafter" in result:
            for split, d in result["drafter"].items():
                ax.plot(slots, d["top1"][:len(slots)], marker="s", label=f"drafter ({split.replace('_', ' ')})")
        ax.set_xlabel("draft slot k (predicts x_(a+k))")
        ax.set_ylabel(label)
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # --epochs 0: no probes, the T = 1 panel is empty
            ax.legend(fontsize=8)
    return [save_figure(fig, out / "probe.png", title=result["machine"]["cpu"])]


REPORT = Report("probe.json", table, table_file="table.md", files=plot)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("features", help="a complete offline feature cache (a training run's output.dir/features)")
    p.add_argument("--offsets", type=int, default=4, help="draft slots probed (default 4)")
    p.add_argument("--vocab", type=int, default=8192, help="draft vocabulary: the most frequent training tokens")
    p.add_argument("--held-out", type=int, default=32, help="sequences held out from the end of the cache")
    p.add_argument("--max-rows", type=int, default=60000, help="training rows (a random subset)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the probes' rows (0: no probes, only --drafter)")
    p.add_argument("--drafter", default=None, metavar="CHECKPOINT",
                   help="a dspark, dflash or eagle3 checkpoint trained on this cache: its teacher-forced agreement "
                        "per slot and the τ of greedy rounds replayed over the held-out and the trained-on answers")
    add_output_arguments(p, "runs/probe")


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """fit linear probes on a feature cache: how much of the tokens 2…K+1 ahead the drafter's inputs hold

    Per draft slot, a linear map of the fused taps before the anchor plus the anchor's embedding,
    read out through the target's own LM head, against the same map of the anchor alone; top-1
    agreement and 1 − TV on held-out sequences; with --drafter, a trained block drafter's own
    teacher-forced agreement and the τ of greedy rounds replayed over the same answers (held out and
    trained on: the memorisation check).  Writes probe.json, table.md and probe.png.
    """
    if not Path(args.features).is_dir():
        print(f"specforge bench probe: {args.features}: no such feature cache", file=sys.stderr)
        raise SystemExit(2)
    return run_probe(args.features, args.offsets, args.vocab, args.held_out, args.max_rows, args.epochs,
                     drafter=args.drafter)


COMMAND = bench_command("probe", _arguments, _measure, REPORT)
