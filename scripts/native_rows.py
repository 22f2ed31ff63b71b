"""Time the two paths of native 4-bit weights against the row count of a pass.

Every Int4Projection of the embedded SmolLM2 (``target.weights=native``) holds the blocks for
torch's int4 kernel and a bf16 copy for oneDNN; this times both over all 120 layer projections,
and the LM head's two paths, for each row count, interleaved and repeated (medians).  It is
where ``KERNEL_ROWS`` and ``HEAD_KERNEL_ROWS`` in ``specforge.runtime.torch.quantized`` come from.

    python scripts/native_rows.py --rows 1 2 4 8 16 64 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specforge.runtime import load_target
from specforge.runtime.torch.quantized import GROUP, Int4Projection, Q8Projection
from specforge.toolkit.projection import onednn_linear


def _kernel(proj: Int4Projection | Q8Projection, x: torch.Tensor) -> None:
    if isinstance(proj, Q8Projection):
        for packed, sz in proj.halves:
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    else:
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, proj.packed, GROUP, proj.scale_zero)


def _dense(proj: Int4Projection | Q8Projection, x: torch.Tensor) -> None:
    onednn_linear(x, proj.dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    target = load_target("smollm2", dtype="bfloat16", weights="native", backend="torch")
    layers = [getattr(layer, a) for layer in target.runtime.layers
              for a in ("qkv_proj", "o_proj", "up_proj", "down_proj")]
    groups = {"layers": [p for p in layers if isinstance(p, Int4Projection)],
              "head": [target.runtime.head_projection]}
    print(f"{'rows':>5} {'layers: kernel':>15} {'dense':>8} {'head: kernel':>13} {'dense':>8}   (ms, medians)")
    with torch.inference_mode():
        for m in args.rows:
            times: dict[tuple[str, str], list[float]] = {}
            for rep in range(args.reps):
                for group, projs in groups.items():
                    xs = {p.in_features: torch.randn(m, p.in_features).bfloat16() for p in projs}
                    paths = (("kernel", _kernel), ("dense", _dense))
                    for name, fn in (paths if rep % 2 == 0 else paths[::-1]):
                        started = time.perf_counter()
                        for p in projs:
                            fn(p, xs[p.in_features])
                        times.setdefault((group, name), []).append((time.perf_counter() - started) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{m:>5} {med['layers', 'kernel']:>15.1f} {med['layers', 'dense']:>8.1f} "
                  f"{med['head', 'kernel']:>13.1f} {med['head', 'dense']:>8.1f}")


if __name__ == "__main__":
    main()
