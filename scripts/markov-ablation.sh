#!/bin/bash
# Markov-head ablation (paper §4.3.2, Figure 4; results in docs/evaluation.md): DSpark with
# correction head `none` vs `markov` at gamma 4, 7 and 16, all trained with the quick preset on the
# same data — the regenerated answers and feature cache of runs/quick-fresh (`specforge run
# --config quick output.dir=runs/quick-fresh`; the first `train` below builds them if that has not
# run) — then tau at T=0 and T=1 on the five eval sets (3 prompts each) and the table
# (scripts/ablation_table.py).  Each step resumes or reuses what an earlier call finished.
# GAMMAS / HEADS narrow the grid.
set -e
cd "$(dirname "$0")/.."
SF=".venv/bin/specforge"
for g in ${GAMMAS:-4 16 7}; do
  for h in ${HEADS:-none markov}; do
    out=runs/ablation/g$g-$h
    if [ "$g" = 7 ] && [ "$h" = markov ]; then out=runs/quick-fresh; fi
    $SF train --config quick output.dir=$out drafter.gamma=$g drafter.head.name=$h \
      features.cache_dir=runs/quick-fresh/features data.regenerate.dir=runs/quick-fresh/regenerated
    over="drafter.checkpoint=$out/drafter correction_head.name=$h"
    [ "$h" != none ] && over="$over correction_head.rank=256"
    $SF eval --config dspark $over --prompts 3 --no-speedup --out runs/ablation/eval-g$g-$h
  done
done
.venv/bin/python scripts/ablation_table.py runs/ablation
