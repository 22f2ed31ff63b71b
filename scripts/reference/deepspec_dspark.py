"""Train DeepSpec's own DSpark on specforge's feature cache, on a CPU: the reference run of
docs/reference-run.md.

    python scripts/reference/deepspec_dspark.py --deepspec ~/src/DeepSpec --features runs/parity/features \
        --out runs/parity/deepspec --steps 200 --sequences-per-step 8 --anchors 512 --layers 2

DeepSpec (github deepseek-ai/DeepSpec, MIT) is not a dependency of specforge and none of its code is
copied here: this script imports its modules from a checkout you give it (``--deepspec``, which must
be at commit ``afdfa7c``) and runs *its* model (``Qwen3DSparkModel``: backbone, vanilla Markov head,
confidence head), *its* loss (``compute_dspark_loss``) and *its* optimizer and schedule
(``BF16Optimizer``: AdamW on float32 master weights, linear warm-up then cosine), with its
trainer's step: ``local_batch_size`` 1, one sequence per micro-batch, gradients accumulated over
``--sequences-per-step`` sequences, the global norm clipped to 1.0.  Its trainer class itself
(FSDP, a CUDA prefetcher, a HFAI suspend controller) does not run on a CPU, so that loop is
written out below; every other place where DeepSpec's code could not run as it is has a patch,
applied at import time, listed in :data:`PATCHES` and written to ``OUT/patches.md``.

The data is specforge's offline feature cache (``specforge train ... features.mode=offline``):
the same token ids, loss masks, tapped layers (DeepSpec's ``target_layer_ids`` are 0-based layer
outputs, as ours) and final hidden states our trainer reads, in the same sequence order.  The
output folder ``OUT/drafter`` is a ``save_pretrained`` folder in DeepSpec's layout, which
``specforge import`` reads; ``OUT/metrics.jsonl`` is the loss curve.  A killed run resumes from
its last checkpoint (``OUT/state``, safetensors only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

COMMIT = "afdfa7c"  # the DeepSpec commit this script was written against (SPEC §7)
MODELING = Path("deepspec/modeling/dspark/qwen3/modeling.py")

PATCHES = [
    ("deepspec.modeling.dspark.qwen3.modeling.create_dspark_attention_mask",
     "flex_attention's BlockMask (CUDA/Triton) replaced by the dense boolean mask of the same `dspark_mask_mod` "
     "(context strictly before the anchor, the block bidirectionally, nothing for dummy blocks), run by "
     "transformers' `sdpa` attention; a dummy block (fewer candidates than anchors) attends to itself only, so "
     "its rows stay finite — they are zero-weighted in the loss either way"),
    ("draft_config._attn_implementation", "'flex_attention' -> 'sdpa' (see above)"),
    ("deepspec.modeling (package __init__)",
     "the package imports only what DSpark on Qwen3 needs (`dspark/common.py`, `dspark/markov_head.py`, "
     "`dspark/loss.py`, `dspark/qwen3/`); the Gemma 4 and EAGLE-3 modules it also imports are not loaded"),
    ("torch.distributed", "a one-process gloo group on the loopback (the loss and the metrics call "
                          "`dist.get_world_size()` / `all_reduce`)"),
    ("BaseTrainer", "not used (FSDP, CUDA prefetcher, HFAI suspend); its step is written out: one sequence per "
                    "micro-batch, loss / accumulation, backward, `clip_grad_norm_(1.0)`, `BF16Optimizer.step()`"),
    ("target config", "SmolLM2 is a Llama model; the draft config is built (by DeepSpec's `build_draft_config`) "
                      "from a `Qwen3Config` with SmolLM2's sizes, RMSNorm eps and RoPE θ (the draft layers are "
                      "Qwen3 layers in DeepSpec, with per-head q/k norm)"),
    ("embeddings and LM head", "`initialize_embeddings_and_head` gets the target's frozen tensors from specforge's "
                               "loader of the same GGUF (DeepSpec reads them with `AutoModelForCausalLM`)"),
    ("checkpoints", "safetensors (master weights, AdamW moments, step) instead of DeepSpec's `torch.save`: "
                    "specforge never loads a pickle"),
]


class ReferenceError(SystemExit):
    """One line naming what is wrong; exit status 2."""

    def __init__(self, message: str) -> None:
        print(f"deepspec_dspark: {message}", file=sys.stderr)
        super().__init__(2)


# -- the checkout -------------------------------------------------------------------------------


def check_checkout(path: Path) -> str:
    """The checkout's full commit; refuses anything that is not DeepSpec at :data:`COMMIT`."""
    if not (path / MODELING).is_file():
        raise ReferenceError(f"--deepspec {path}: not a DeepSpec checkout (no {MODELING}); clone "
                             f"github.com/deepseek-ai/DeepSpec and check out {COMMIT}")
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise ReferenceError(f"--deepspec {path}: not a git checkout, so its commit cannot be checked; "
                             f"it must be DeepSpec at {COMMIT}") from None
    if not head.startswith(COMMIT):
        raise ReferenceError(f"--deepspec {path}: at commit {head[:12]}; this script needs DeepSpec at {COMMIT} "
                             f"(git -C {path} checkout {COMMIT})")
    return head


def import_deepspec(path: Path) -> types.SimpleNamespace:
    """DeepSpec's DSpark modules, with the patches of :data:`PATCHES` applied."""
    import torch

    # Package shells for `deepspec` and `deepspec.modeling` whose __init__ is not run: it imports
    # the Gemma 4 and EAGLE-3 models as well, which DSpark on a Qwen3-shaped draft does not use.
    for name in ("deepspec", "deepspec.modeling"):
        shell = types.ModuleType(name)
        shell.__path__ = [str(path / name.replace(".", "/"))]
        sys.modules[name] = shell
    sys.path.insert(0, str(path))
    from deepspec.modeling.dspark.loss import compute_dspark_loss
    from deepspec.modeling.dspark.qwen3 import modeling
    from deepspec.modeling.dspark.qwen3.config import build_draft_config
    from deepspec.utils import metrics
    from deepspec.utils.optim import BF16Optimizer

    def dense_mask(*, anchor_positions, block_keep_mask, seq_len, block_size, device):
        bsz, num_blocks = anchor_positions.shape
        q = torch.arange(num_blocks * block_size, device=device)
        kv = torch.arange(seq_len + num_blocks * block_size, device=device)
        q_block = q // block_size
        anchor = anchor_positions[:, q_block]  # [B, Q]
        context = (kv[None, None] < seq_len) & (kv[None, None] < anchor[..., None])
        kv_block = (kv - seq_len).div(block_size, rounding_mode="floor")
        draft = (kv[None] >= seq_len) & (q_block[:, None] == kv_block[None])  # [Q, KV]
        keep = block_keep_mask[:, q_block][..., None]  # [B, Q, 1]
        mask = (context | draft[None]) & keep
        mask = mask | (~keep & draft[None])  # a dummy block sees itself: finite rows, zero loss weight
        return mask[:, None]  # [B, 1, Q, KV]

    modeling.create_dspark_attention_mask = dense_mask
    return types.SimpleNamespace(modeling=modeling, build_draft_config=build_draft_config,
                                 compute_dspark_loss=compute_dspark_loss, metrics=metrics,
                                 BF16Optimizer=BF16Optimizer)


class _ModelArgs(dict):
    """DeepSpec's config objects: a dict read by attribute and by ``in``."""

    __getattr__ = dict.__getitem__


def qwen3_config(target_args: dict, rope_theta: float, max_positions: int):
    from transformers import Qwen3Config

    a = target_args
    return Qwen3Config(vocab_size=a["vocab_size"], hidden_size=a["dim"], intermediate_size=a["intermediate_size"],
                       num_hidden_layers=a["n_layers"], num_attention_heads=a["n_heads"],
                       num_key_value_heads=a["n_kv_heads"], head_dim=a["head_dim"], rms_norm_eps=a["norm_eps"],
                       rope_theta=rope_theta, max_position_embeddings=max_positions, attention_bias=False,
                       tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02)


# -- data ---------------------------------------------------------------------------------------


def data_hash(manifest) -> str:
    """sha256 of the ids and masks the cache was computed from (its shards' input hashes)."""
    h = hashlib.sha256()
    for shard in manifest.shards:
        h.update(shard.inputs_sha256.encode())
    return h.hexdigest()


# -- state (safetensors) --------------------------------------------------------------------------


def save_state(directory: Path, model, optimizer, step: int, seconds: float) -> None:
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, p in enumerate(optimizer.fp32_params):
        tensors[f"master.{i}"] = p.detach().contiguous()
        st = optimizer.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                tensors[f"{key}.{i}"] = st[key].contiguous()
    save_file(tensors, str(tmp / "state.safetensors"))
    adam_step = next((float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s), 0.0)
    (tmp / "state.json").write_text(json.dumps({"step": step, "adam_step": adam_step, "seconds": seconds}))
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    tmp.rename(directory)


def load_state(directory: Path, model, optimizer) -> tuple[int, float]:
    import torch
    from safetensors.torch import load_file

    meta = json.loads((directory / "state.json").read_text())
    tensors = load_file(str(directory / "state.safetensors"))
    with torch.no_grad():
        for i, (p, mp) in enumerate(zip(optimizer.fp32_params, optimizer.model_params)):
            p.copy_(tensors[f"master.{i}"])
            mp.copy_(p.to(mp.dtype))
            if f"exp_avg.{i}" in tensors:
                optimizer.optimizer.state[p] = {"step": torch.tensor(meta["adam_step"]),
                                                "exp_avg": tensors[f"exp_avg.{i}"],
                                                "exp_avg_sq": tensors[f"exp_avg_sq.{i}"]}
    # The learning rate is a pure function of the steps taken: replay them.  (DeepSpec's warm-up
    # scheduler stops counting its own last_epoch once the cosine takes over, so that is not it.)
    for _ in range(int(meta["step"])):
        optimizer.scheduler.step()
    return int(meta["step"]), float(meta["seconds"])


# -- the imported drafter computes what DeepSpec's computes --------------------------------------


def import_check(model, ds, feature, imported: Path, target, anchors: int) -> dict:
    """DeepSpec's draft logits and confidences on one sequence against those of ``specforge
    import``'s checkpoint of the same weights, on the same anchors (float32 both): the comparison of
    the two trainings is only about training if this agrees."""
    import torch

    from specforge.toolkit.layers import SharedWeights
    from specforge_plugins.drafters.block.checkpoint import load_drafter

    common = sys.modules["deepspec.modeling.dspark.common"]
    reference = model.float().eval()
    with torch.no_grad():  # the target's own frozen tensors, not their bf16 copies: what the import reads
        reference.embed_tokens.weight.copy_(target.runtime.embed.float())
        reference.lm_head.weight.copy_(target.runtime.lm_head.float())
    f = feature
    ids, mask = f.input_ids[None], f.loss_mask[None]
    ctx = f.taps.flatten(1)[None].float()
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    anchor_pos, keep = common.sample_anchor_positions(seq_len=ids.shape[1], loss_mask=mask, num_anchors=anchors,
                                                      device=ids.device)
    torch.set_rng_state(state)  # DeepSpec's forward draws the same anchors from the same state
    with torch.no_grad():
        theirs = reference(input_ids=ids, target_hidden_states=ctx, loss_mask=mask,
                           target_last_hidden_states=f.hidden[None].float())
        backbone, head, confidence, _ = load_drafter(imported)
        backbone = backbone.float().eval().bind(SharedWeights.from_target(target.runtime))
        for module in (head, confidence):
            if module is not None:
                module.bind(target)
        a = anchor_pos[0][keep[0]]
        block = backbone.make_block(ids[0, a])
        hidden, logits = backbone(block, ctx, a, ctx_index=torch.zeros(len(a), dtype=torch.long))
        prev = torch.cat([ids[0, a][:, None], theirs.target_ids[0][keep[0]][:, :-1]], dim=1)
        if head is not None:
            logits = head.forward_train(logits, prev, hidden)
        conf = confidence.logits(hidden, prev) if confidence is not None else None
    valid = theirs.eval_mask[0][keep[0]]
    d_logits = (logits - theirs.draft_logits[0][keep[0]].float())[valid].abs().max()
    mine_top, theirs_top = logits.argmax(-1)[valid], theirs.draft_logits[0][keep[0]].argmax(-1)[valid]
    out = {"blocks": int(keep.sum()), "max_abs_logit_diff": float(d_logits),
           "logit_scale": float(theirs.draft_logits[0][keep[0]][valid].abs().max()),
           "argmax_agreement": float((mine_top == theirs_top).float().mean())}
    if conf is not None and theirs.confidence_pred is not None:
        out["max_abs_confidence_diff"] = float((conf - theirs.confidence_pred[0][keep[0]])[valid].abs().max())
    return out


# -- the run --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspec", type=Path, required=False, help=f"a DeepSpec checkout at {COMMIT}")
    p.add_argument("--features", type=Path, required=True, help="a complete specforge offline feature cache")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target", default=None, help="the target that wrote the cache (default: the cache's own name)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--sequences-per-step", type=int, default=8, help="DeepSpec's global_batch_size")
    p.add_argument("--anchors", type=int, default=512, help="DeepSpec's num_anchors per sequence")
    p.add_argument("--eval-sequences", type=int, default=0, help="held out from the end of the cache (as ours)")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--layers", type=int, default=2, help="num_draft_layers")
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="a vocabulary id used as MASK (default: the tokenizer's unk, else pad, else id 0)")
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--decay", type=float, default=4.0, help="loss_decay_gamma")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--checkpoint-interval", type=int, default=25)
    p.add_argument("--seed", type=int, default=42, help="DeepSpec's config seed")
    args = p.parse_args(argv)
    if args.deepspec is None:
        raise ReferenceError(f"give --deepspec DIR, a checkout of github.com/deepseek-ai/DeepSpec at {COMMIT}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commit = check_checkout(args.deepspec.expanduser())
    if not (args.features / "manifest.json").is_file() and not any(args.features.glob("*.json")):
        raise ReferenceError(f"--features {args.features}: no feature cache there (make one with specforge train)")

    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from specforge.features import FeatureCache
    from specforge.machine import machine
    from specforge.runtime import load_target
    from specforge.toolkit.formats import rope_theta as rope_base
    from specforge.training.data import epoch_order

    ds = import_deepspec(args.deepspec.expanduser())
    cache = FeatureCache(args.features)
    if not cache.complete:
        raise ReferenceError(f"--features {args.features}: the cache is not complete; finish it with specforge train")
    target = load_target(args.target or cache.manifest.target_name, dtype="float32", backend="torch")
    cache = FeatureCache(args.features, target)  # now also checked against the target that wrote it
    rt = target.runtime
    rope_theta = rope_base(target.hf_model.config.to_dict()) or 10000.0

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(args.seed)

    tok = target.tokenizer
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = next((i for i in (getattr(tok, "unk_token_id", None), getattr(tok, "pad_token_id", None))
                        if i is not None), 0)
    model_args = _ModelArgs(block_size=args.block_size, num_draft_layers=args.layers,
                            target_layer_ids=list(cache.layer_ids), mask_token_id=mask_id, num_anchors=args.anchors,
                            markov_rank=args.markov_rank, markov_head_type="vanilla", confidence_head_alpha=1.0,
                            confidence_head_with_markov=True, loss_decay_gamma=args.decay, ce_loss_alpha=0.1,
                            l1_loss_alpha=0.9)
    config = ds.build_draft_config(target_config=qwen3_config(cache.manifest.target_args, rope_theta,
                                                              target.max_positions), model_args=model_args)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = ds.modeling.Qwen3DSparkModel(config).to(dtype=dtype)
    embed = torch.nn.Embedding.from_pretrained(rt.embed.detach().float())
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head.weight.data.copy_(rt.lm_head.detach().float())
    model.initialize_embeddings_and_head(embed_tokens=embed, lm_head=head, freeze=True)
    optimizer = ds.BF16Optimizer(model, lr=args.lr, total_steps=args.steps, warmup_ratio=args.warmup_ratio,
                                 weight_decay=args.weight_decay)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    run = {"deepspec_commit": commit, "features": str(args.features), "data_sha256": data_hash(cache.manifest),
           "sequences": len(cache), "args": {k: str(v) for k, v in vars(args).items()}, "mask_token_id": mask_id,
           "rope_theta": rope_theta, "machine": machine()}
    state_dir = out / "state"
    step, seconds = 0, 0.0
    if (state_dir / "state.json").is_file():
        recorded = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
        if recorded.get("data_sha256") not in (None, run["data_sha256"]):
            raise ReferenceError(f"{out / 'run.json'}: this run was trained on other data (sha256 "
                                 f"{recorded['data_sha256'][:12]}…, now {run['data_sha256'][:12]}…); use a new --out")
        step, seconds = load_state(state_dir, model, optimizer)
        print(f"resuming at step {step}", file=sys.stderr)
    (out / "run.json").write_text(json.dumps(run, indent=2))
    (out / "patches.md").write_text("# Patches to DeepSpec @ %s for a CPU run\n\n" % commit[:12]
                                    + "".join(f"- **{where}**: {what}\n" for where, what in PATCHES))

    n = len(cache)
    held = list(range(n - args.eval_sequences, n)) if args.eval_sequences else []
    groups = [[i for i in range(n) if i not in set(held)]]
    by_index = {f.index: f for f in cache}  # the cache is small enough to hold (≤ a few GB) in this script

    def forward(index: int, train: bool):
        f = by_index[index]
        with torch.set_grad_enabled(train):
            outputs = model(input_ids=f.input_ids[None], target_hidden_states=f.taps.flatten(1)[None].to(dtype),
                            loss_mask=f.loss_mask[None], target_last_hidden_states=f.hidden[None].to(dtype))
            return ds.compute_dspark_loss(outputs=outputs, loss_decay_gamma=args.decay, ce_loss_alpha=0.1,
                                          l1_loss_alpha=0.9, confidence_head_alpha=1.0)

    def summary(prefix: str) -> dict:
        m = ds.metrics.flush()
        keep = {"ce_loss": "ce", "l1_loss": "tv", "confidence_loss": "conf", "tau_probabilistic": "tau"}
        rec = {keep[k.split("/", 1)[1]]: v for k, v in m.items() if k.split("/", 1)[1] in keep}
        rec.update({f"accept_rate@{int(k.rsplit('@', 1)[1]) + 1}": v for k, v in m.items() if "accept_rate@" in k})
        return {"split": prefix, **rec}

    per_epoch = max(1, len(groups[0]) // args.sequences_per_step)
    metrics_file = (out / "metrics.jsonl").open("a")
    bar = tqdm(total=args.steps, initial=step, desc="DeepSpec DSpark (reference)")
    while step < args.steps:
        epoch, k = divmod(step, per_epoch)
        order = epoch_order(groups, args.seed, epoch, 1)
        batch = order[k * args.sequences_per_step:(k + 1) * args.sequences_per_step]
        t0 = time.process_time()
        model.train()
        ds.metrics.reset()
        for index in batch:
            (forward(index, True) / len(batch)).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0))
        lr = optimizer.optimizer.param_groups[0]["lr"]
        optimizer.step()
        step += 1
        seconds += time.process_time() - t0
        rec = {**summary("train"), "step": step, "lr": lr, "grad_norm": grad_norm, "cpu_seconds": seconds}
        if held and (step % args.eval_interval == 0 or step == args.steps):
            model.eval()
            ds.metrics.reset()
            torch.manual_seed(0)  # the same anchors at every evaluation
            for index in held:
                forward(index, False)
            metrics_file.write(json.dumps({**summary("eval"), "step": step, "cpu_seconds": seconds}) + "\n")
        metrics_file.write(json.dumps(rec) + "\n")
        metrics_file.flush()
        bar.update(1)
        bar.set_postfix(tau=f"{rec.get('tau', float('nan')):.3f}")
        if step % args.checkpoint_interval == 0 or step == args.steps:
            save_state(state_dir, model, optimizer, step, seconds)
    bar.close()
    drafter = out / "drafter"
    model.save_pretrained(str(drafter), safe_serialization=True)
    from specforge.interop import import_checkpoint

    imported = out / "imported"
    if imported.exists():
        shutil.rmtree(imported)
    import_checkpoint(drafter, imported, "deepspec", target)
    check = import_check(model, ds, by_index[held[0] if held else 0], imported, target, min(args.anchors, 64))
    run["import_check"] = check
    (out / "run.json").write_text(json.dumps(run, indent=2))
    print(f"saved {drafter} (DeepSpec's layout) and {imported} (specforge import); on {check['blocks']} blocks "
          f"the imported drafter's logits differ from DeepSpec's by at most {check['max_abs_logit_diff']:.2e} "
          f"(logits up to {check['logit_scale']:.1f})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
