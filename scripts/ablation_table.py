"""Markdown table of the Markov-head ablation (scripts/markov-ablation.sh): per γ and head, the
held-out τ̂ of training and the engine's τ per temperature (mean over the eval sets), with the
correction head's share of a round and the relative gain of `markov` over `none` in τ − 1."""

import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/ablation")
rows = {}
for ev in sorted(root.glob("eval-g*-*/eval.json")):
    g, head = ev.parent.name.removeprefix("eval-g").split("-", 1)
    d = json.loads(ev.read_text())
    res = d["results"]
    taus = {t: sum(r["tau"] for r in res if r["temperature"] == t) / max(1, sum(r["temperature"] == t for r in res))
            for t in sorted({r["temperature"] for r in res})}
    share = [r["latency_share"].get("correction_head", 0.0) for r in res]
    train_dir = Path("runs/quick-fresh") if (g, head) == ("7", "markov") else root / f"g{g}-{head}"
    held = [json.loads(x) for x in (train_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    rows[(int(g), head)] = (held[-1]["tau"] if held else None, taus, sum(share) / len(share))
print("| γ | head | held-out τ̂ | τ T=0 | τ T=1 | head share of a round |")
print("|---|---|---|---|---|---|")
for (g, head), (held, taus, share) in sorted(rows.items()):
    cells = " | ".join(f"{v:.3f}" for v in taus.values())
    held_cell = f"{held:.3f}" if held else "—"
    print(f"| {g} | {head} | {held_cell} | {cells} | {100 * share:.1f} % |")
for g in sorted({g for g, _ in rows}):
    if (g, "none") in rows and (g, "markov") in rows:
        n, m = rows[(g, "none")], rows[(g, "markov")]
        gains = [f"T={t:g}: {100 * ((m[1][t] - 1) / (n[1][t] - 1) - 1):+.0f} %" for t in n[1] if n[1][t] > 1]
        held = f"held-out {100 * ((m[0] - 1) / (n[0] - 1) - 1):+.0f} %" if n[0] and m[0] else ""
        print(f"γ={g}: markov vs none in τ − 1: {held}, " + ", ".join(gains))
