"""Side by side: our training run and DeepSpec's on the same data (docs/reference-run.md).

Reads each run's ``metrics.jsonl`` (``specforge train``'s and ``deepspec_dspark.py``'s: one JSON
row per training step, ``"split": "eval"`` rows on the held-out sequences) and writes
``OUT/parity.png`` (training cross-entropy, held-out τ̂, held-out acceptance per draft slot) and
``OUT/parity.md`` (the held-out rows).  The two cross-entropies are not on one scale (ours sums each term
over a block's slots and averages over blocks, DeepSpec averages over weighted tokens), so each
is drawn relative to its own first step; τ̂ and acceptance are the same statistics in both.

    python scripts/reference/compare_runs.py runs/parity/ours runs/parity/deepspec --out runs/parity/compare
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rows(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") != "eval"], [r for r in rows if r.get("split") == "eval"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ours", type=Path)
    p.add_argument("deepspec", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from specforge.machine import machine
    from specforge.plots import new_figure, save_figure

    runs = {"specforge": _rows(args.ours), "DeepSpec": _rows(args.deepspec)}
    args.out.mkdir(parents=True, exist_ok=True)
    fig = new_figure(13, 4)
    loss_ax, tau_ax, acc_ax = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
    # the draft slots both runs report (accept_rate@k), for the table and the plot alike
    slots = sorted(set.intersection(*({int(k.split("@")[1]) for k in evals[-1] if k.startswith("accept_rate@")}
                                      for _, evals in runs.values())))
    lines = ["| run | step | held-out τ̂ | " + " | ".join(f"slot {k}" for k in slots) + " |",
             "|---|---|---|" + "---|" * len(slots)]
    for name, (train, evals) in runs.items():
        loss_ax.plot([r["step"] for r in train], [r["ce"] / train[0]["ce"] for r in train], label=name)
        tau_ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], marker="o", label=name)
        acc_ax.plot(slots, [evals[-1][f"accept_rate@{k}"] for k in slots], marker="s",
                    label=f"{name}, step {evals[-1]['step']}")
        for r in evals:
            lines.append(f"| {name} | {r['step']} | {r['tau']:.3f} | "
                         + " | ".join(f"{r[f'accept_rate@{k}']:.3f}" for k in slots) + " |")
    for ax, (xlabel, ylabel) in zip((loss_ax, tau_ax, acc_ax), (("step", "training cross-entropy / its first step"),
                                                                ("step", "held-out τ̂"),
                                                                ("draft slot", "held-out acceptance"))):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, args.out / "parity.png", title=machine()["cpu"])
    (args.out / "parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
