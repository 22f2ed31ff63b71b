"""Replay a block drafter on the training path over the engine's own output, to compare with the
τ the engine measured on it (docs/reference-run.md#replay).

    specforge generate --config dspark --prompts P.jsonl --json engine.max_batch=1 scheduler.name=fixed \
        sampling.temperature=0 drafter.checkpoint=CKPT > out.json
    python scripts/replay_engine_output.py CKPT out.json P.jsonl [--target smollm2]

Each answer is put after its prompt's generation prompt (the ids the engine decoded from), the
target computes the drafter's taps over it as the feature cache would, and
:func:`specforge_plugins.drafters.block.replay.replay_rounds` walks the greedy rounds.  The engine's own
counts are printed beside it: if the two differ beyond the target's rounding, serving feeds the
drafter something training did not.
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("generated", help="`specforge generate --json` output")
    p.add_argument("prompts", help="the prompts file given to specforge generate")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="auto", help="the target's dtype in the engine run")
    args = p.parse_args()

    from specforge.bench.probe import replayable_drafter
    from specforge.evalsets import read_prompt_file
    from specforge.features import compute_features
    from specforge.runtime import load_target

    target = load_target(args.target, dtype=args.dtype, backend="torch")
    outputs = json.load(open(args.generated))
    prompts = read_prompt_file(args.prompts)
    drafter = replayable_drafter(args.checkpoint, target)
    pairs = []
    for out, prompt in zip(outputs, prompts):
        ids = target.encode(prompt, chat=True)
        mask = torch.tensor([0] * len(ids) + [1] * len(out["tokens"]))
        pairs.append((torch.tensor(ids + out["tokens"]), mask))
    replay = drafter.replay(compute_features(target, pairs, drafter.feature_layers), target)
    rounds = sum(o["stats"]["rounds"] for o in outputs)
    tokens = sum(len(o["tokens"]) for o in outputs)
    accepted = [sum(o["stats"]["accepted_per_position"][k] for o in outputs) for k in range(len(replay["top1"]))]
    reached = [sum(o["stats"]["reached_per_position"][k] for o in outputs) for k in range(len(replay["top1"]))]
    print(f"engine:  {rounds} rounds, τ {tokens / rounds:.3f}, acceptance per slot "
          + " ".join(f"{a / r:.2f}" if r else "-" for a, r in zip(accepted, reached)))
    print(f"replay:  {replay['rounds']} rounds, τ {replay['replay_tau']:.3f}; teacher-forced agreement per slot "
          + " ".join(f"{v:.2f}" for v in replay["top1"]))


if __name__ == "__main__":
    main()
