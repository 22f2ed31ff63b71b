"""Package a drafter trained by `specforge train` as a shipped drafter (``shipped:<name>``).

    python scripts/ship_drafter.py --run runs/cpu --name smollm2-135m-instruct \
        [--checkpoint runs/cpu/checkpoints/step-00002400/drafter] [--eval runs/ship-eval/eval.json]

Writes ``plugins/drafters/shipped/<name>/``: the weights in bf16 (the dtype the engine runs them
in on the embedded target, so nothing changes at inference) with their sha256 in config.json,
the learning curve, and MODEL_CARD.md — training config, data manifest, steps, CPU-hours,
held-out τ̂, and, given an `specforge eval --json` result, τ / speedup / draft-vocabulary coverage
per eval set.  Every number in the card is read from the run's own files.

A shipped drafter is one others can serve: a drafter without q/k norm in its draft layers (trained
with ``drafter.qk_norm=false``, or before it was the default) exports to no engine's layout (vLLM,
SGLang, DeepSpec and llama.cpp read Qwen3 layers, which have it) and is refused unless
``--allow-unexportable`` is given.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from specforge.machine import machine
from specforge.training.checkpoint import latest_checkpoint
from specforge.training.curve import learning_curve, plot_learning_curve
from specforge.toolkit.checkpoints import CONFIG, WEIGHTS
from specforge_plugins.drafters.block.checkpoint import load_drafter, save_drafter

SHIPPED = Path(__file__).resolve().parents[1] / "plugins" / "drafters" / "shipped"


def _source(run: Path, checkpoint: Path | None) -> tuple[Path, dict]:
    """The drafter directory to ship and the trainer state of its checkpoint (steps)."""
    if checkpoint is None:
        ckpt, _ = latest_checkpoint(run / "checkpoints")
        if ckpt is None:
            raise SystemExit(f"no complete checkpoint under {run / 'checkpoints'}")
        checkpoint = ckpt / "drafter"
    state = json.loads((checkpoint.parent / "trainer.json").read_text())
    return checkpoint, state


def _data_manifest(run: Path) -> dict:
    progress = json.loads((run / "regenerated" / "progress.json").read_text())
    shards = progress["shards"]
    return {"source": progress["source"], "target": progress["target"], "sampling": progress["sampling"],
            "context_limit": progress["context_limit"], "decoder": progress["decoder"],
            "answers_written": sum(s["written"] for s in shards),
            "prompts_skipped": sum(len(s["skipped"]) for s in shards),
            "answer_tokens": sum(s["new_tokens"] for s in shards)}


def _lineage(train_cfg: dict) -> list[str]:
    """The card's line on the drafter a run started from (``drafter.init_from``): its steps and,
    from its own card, its training time — a warm start's cost is the sum."""
    ref = (train_cfg.get("drafter") or {}).get("init_from")
    if not ref:
        return []
    from specforge.interop import drafter_directory

    start = drafter_directory(ref)
    info = json.loads((start / CONFIG).read_text()).get("drafter", {})
    steps = info.get("shipped_from_step") or info.get("trained_steps")
    card = start / "MODEL_CARD.md"
    hours = re.search(r"([0-9.]+) CPU-hours", card.read_text()) if card.is_file() else None
    return [f"- started from `{ref}` as shipped then (`drafter.init_from`: every tensor copied, its draft vocabulary kept, the q/k "
            f"norms it lacked starting at one), itself trained for {steps or '?'} steps"
            + (f" and {hours.group(1)} CPU-hours" if hours else "") + "; the lines below are this run's"]


def _eval_table(result: dict) -> list[str]:
    arms = {"this drafter": result["results"], **{k: v["results"] for k, v in result.get("compare", {}).items()}}
    lines = ["| eval set | T | " + " | ".join(f"{a} τ | {a} ×plain" for a in arms) + " | vocab coverage |",
             "|---|---|" + "---|---|" * len(arms) + "---|"]
    for i, r in enumerate(result["results"]):
        cells = [f"{rows[i]['tau']:.2f} | {rows[i].get('speedup', float('nan')):.2f}" for rows in arms.values()]
        cov = r.get("vocab_coverage")
        lines.append(f"| {r['dataset']} | {r['temperature']:g} | " + " | ".join(cells)
                     + f" | {'-' if cov is None else f'{100 * cov:.1f} %'} |")
    s = result["settings"]
    lines.append("")
    lines.append(f"{s['prompts']} prompts per set, {s['max_new_tokens']} new tokens, concurrency {s['concurrency']}, "
                 + ("speedups against plain decoding of the same engine measured in the same run."
                    if s.get("speedup", True) else "τ only (no plain baseline in this run)."))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="the training output directory")
    ap.add_argument("--name", required=True, help="shipped name (shipped:<name>)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="drafter directory (default: the newest checkpoint's)")
    ap.add_argument("--eval", type=Path, action="append", default=[],
                    help="eval.json of this drafter (specforge eval); repeatable: one table each")
    ap.add_argument("--machine", default=None, help="where it was trained (default: this machine's CPU)")
    ap.add_argument("--allow-unexportable", action="store_true",
                    help="ship a drafter without q/k norm (no engine's layout can hold it)")
    args = ap.parse_args()

    source, state = _source(args.run, args.checkpoint)
    backbone, head, confidence, drafter_cfg = load_drafter(source)
    meta = json.loads((source / CONFIG).read_text())
    if not backbone.config.qk_norm and not args.allow_unexportable:
        raise SystemExit(f"{source}: its draft layers have no q/k norm, so vLLM, SGLang, DeepSpec and llama.cpp "
                         "cannot run it (specforge export refuses it); train with drafter.qk_norm=true (the "
                         "default), or pass --allow-unexportable")
    out = SHIPPED / args.name
    train_cfg = json.loads((source.parent / "train_config.json").read_text())
    start = _lineage(train_cfg)  # read before the old version (perhaps the start itself) is replaced
    if out.exists():
        shutil.rmtree(out)
    bf16 = [None if m is None else m.to(torch.bfloat16) for m in (backbone, head, confidence)]
    save_drafter(out, *bf16, {**drafter_cfg, "shipped_from_step": state["step"]}, method=meta.get("method"),
                 target=meta.get("target"))

    records = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [p for p in learning_curve(records) if p["step"] <= state["step"]]
    plot_learning_curve(curve, out / "learning-curve.png", title=f"shipped:{args.name}")
    data = _data_manifest(args.run)
    last = curve[-1] if curve else {}
    record = json.loads((out / CONFIG).read_text())["files"][WEIGHTS]
    cpu = args.machine or machine()["cpu"]
    card = [
        f"# shipped:{args.name}",
        "",
        f"A {meta.get('method')} drafter for `{meta.get('target')}` ({train_cfg['target']['dtype']}), trained with "
        f"`specforge train --config cpu` on {cpu}. Use it with `specforge generate --config dspark` "
        f"(or `drafter.checkpoint=shipped:{args.name}` in any pipeline).",
        "",
        "## Weights",
        f"- `{WEIGHTS}`: {record['bytes'] / 2**20:.1f} MiB, bf16, sha256 `{record['sha256']}` "
        "(checked on every load)",
        f"- backbone: {backbone.config.draft_layers} layers tapping target layers {list(backbone.config.tap_layers)}, "
        f"γ = {backbone.config.gamma}, draft vocabulary {backbone.config.draft_vocab_size or 'full'}",
        f"- correction head: {None if head is None else meta['head']['name']}; confidence head: "
        f"{None if confidence is None else meta['confidence']['name']}",
        f"- q/k norm in the draft layers: {'yes' if backbone.config.qk_norm else 'no (not exportable)'}",
        "",
        "## Serving it elsewhere",
        *(["```bash",
           f"specforge export shipped:{args.name} --to llama.cpp --out {args.name}.gguf   # llama.cpp (docs/llama-cpp.md)",
           f"specforge export shipped:{args.name} --to vllm --out {args.name}-vllm",
           "```"] if backbone.config.qk_norm else
          ["No engine's layout holds draft layers without q/k norm: retrain with drafter.qk_norm=true."]),
        "",
        "## Training",
        *start,
        f"- steps: {state['step']} of {state['total_steps']} ({state['steps_per_epoch']} per epoch)",
        f"- training time: {last.get('hours', float('nan')):.2f} h wall, "
        f"{last.get('cpu_hours', float('nan')):.2f} CPU-hours (step time × threads; evaluation excluded)",
        f"- held-out τ̂ (γ-block, T = 1, teacher-forced): {last.get('tau', float('nan')):.3f} at step {last.get('step')}",
        "- learning curve: `learning-curve.png`",
        "",
        "## Data",
        f"- prompts: the first {data['source']['count']} conversations of {data['source']['name']} "
        f"(sha256 {data['source']['sha256'][:16]}…), first turn only",
        f"- answers regenerated by the target itself ({data['decoder']}), sampling {data['sampling']}, "
        f"context limit {data['context_limit']}",
        f"- {data['answers_written']} answers, {data['answer_tokens']} answer tokens; "
        f"{data['prompts_skipped']} prompts skipped (longer than the context limit)",
        "",
    ]
    if args.eval:
        card += ["## Measured"]
        for path in args.eval:
            card += ["", f"`{path.name}` of `{path.parent.name}`:", "", *_eval_table(json.loads(path.read_text())), ""]
    card += ["## Training config", "```json", json.dumps(train_cfg, indent=2), "```", ""]
    (out / "MODEL_CARD.md").write_text("\n".join(card))
    print(f"wrote {out} ({record['bytes'] / 2**20:.1f} MiB weights)")


if __name__ == "__main__":
    main()
