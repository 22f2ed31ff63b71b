"""Fit a calibrator on a pipeline's own rounds: ``specforge calibrate``
(docs/design/calibration-scheduling.md#calibrating-a-pipeline-specforge-calibrate).

1. *Rounds.*  The pipeline decodes prompts drawn *between* the ones ``specforge eval`` picks from
   each set (disjoint from them at the same count), with every drafted token verified
   (``scheduler: fixed``) and confidences left raw (``calibrator: identity``), so that every
   position of every round is observed.  The engine hands each verified round to a recorder
   (:class:`~specforge.components.RoundOutcome`): raw c_k, verified ℓ and accepted n.
2. *Split.*  Rounds of even-numbered prompts fit the calibrator, rounds of odd-numbered ones
   score it — a held-out split by prompt, not by round, since one prompt's rounds are alike.
3. *Fit and report.*  At each temperature separately (acceptance at T = 0 and T = 1 differ, so a
   calibrator is fitted for the temperature it will serve), the calibrator is fitted and ECE,
   AUROC and Brier of the cumulative survival Π_{i≤k} ĉ_i are reported per position before and
   after, on the held-out rounds; its file and a reliability diagram (paper Fig. 6) are written.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.components import CalibrationData, RoundOutcome

__all__ = ["CalibrateSettings", "RoundRecorder", "calibrate", "calibration_table"]


@dataclass
class CalibrateSettings:
    """What to decode and what to fit."""

    datasets: Sequence[str] = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
    prompts: int = 16  # per dataset
    max_new_tokens: int = 128
    temperatures: Sequence[float] = (0.0, 1.0)
    calibrator: str = "sts"
    eval_dir: str | None = None
    seed: int = 0
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # the calibrator's config keys

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["datasets"], d["temperatures"] = list(self.datasets), list(self.temperatures)
        d.pop("progress")
        return d


class RoundRecorder:
    """An engine round observer that keeps each verified round's raw confidences and outcome,
    tagged with the request it belongs to."""

    def __init__(self) -> None:
        self.outcomes: list[RoundOutcome] = []

    def __call__(self, outcome: RoundOutcome) -> None:
        self.outcomes.append(outcome)

    def data(self, keep=lambda request_id: True) -> CalibrationData:
        """The recorded rounds of the requests ``keep`` accepts that drafted something, padded to
        the widest block (a padded position was not verified, so it counts nowhere)."""
        rows = [(o, i) for o in self.outcomes for i, rid in enumerate(o.request_ids)
                if keep(rid) and int(o.available[i]) > 0]
        width = max((o.confidence.shape[1] for o, _ in rows), default=0)
        conf = torch.full((len(rows), width), 0.5, dtype=torch.float64)
        for j, (o, i) in enumerate(rows):
            conf[j, : o.confidence.shape[1]] = o.confidence[i].to(torch.float64)
        accepted = torch.tensor([int(o.accepted[i]) for o, i in rows], dtype=torch.long)
        verified = torch.tensor([int(o.verified[i]) for o, i in rows], dtype=torch.long)
        return CalibrationData(conf, accepted, verified)


def _held_out_prompts(settings: CalibrateSettings) -> list[Any]:
    """``prompts`` per set, drawn halfway between the rows ``specforge eval`` picks for the same count."""
    from specforge.evalsets import BenchPrompt, load_turns

    out = []
    for name in settings.datasets:
        rows = load_turns(name, settings.eval_dir)
        k = min(settings.prompts, len(rows) // 2 or 1)
        out.extend(BenchPrompt(Path(name).stem, i, rows[i])
                   for i in sorted({(2 * j + 1) * len(rows) // (2 * k) for j in range(k)}))
    return out


def calibrate(pipeline: Any, settings: CalibrateSettings, out_dir: str | Path, target: Any = None) -> dict[str, Any]:
    """Record, split, fit and report at each temperature (see the module docstring); writes
    ``calibrator-T<t>.safetensors``, ``reliability-T<t>.png`` and ``calibration.json`` under
    ``out_dir`` and returns the JSON-ready result."""
    from tqdm.auto import tqdm

    from specforge.config import load_pipeline
    from specforge.engine import Engine, GenerationRequest
    from specforge.engine.engine import drafter_identity
    from specforge.evalsets import apply_chat_template
    from specforge.metrics import calibration_report
    from specforge.plots import reliability_diagram
    from specforge.plugins import get_host
    from specforge.target import TargetModel

    if pipeline.component("drafter") is None:
        from specforge.config import ConfigError

        raise ConfigError(["drafter.name: the pipeline has no drafter, so there are no rounds to calibrate on"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = get_host()
    # Every drafted token verified, confidences raw: every position of every round is observed.
    recording = load_pipeline(["default"], sections={**pipeline.to_dict(), "scheduler": {"name": "fixed"},
                                                     "calibrator": {"name": "identity"}})
    target = target or TargetModel.load(pipeline.target.model, pipeline.target.dtype, pipeline.target.compile,
                                        pipeline.target.weights)
    engine = Engine.from_pipeline(recording, target)
    prompts = _held_out_prompts(settings)
    ids = [apply_chat_template(target.tokenizer, p.text) for p in prompts]
    result: dict[str, Any] = {"pipeline": pipeline.to_dict(), "settings": settings.to_dict(),
                              "gamma": getattr(engine.drafter, "gamma", None), "prompts": len(prompts),
                              "temperatures": {}}
    for t in tqdm(list(settings.temperatures), desc="calibrate", unit="T", disable=not settings.progress,
                  file=sys.stderr):
        recorder = RoundRecorder()
        engine.round_observers[:] = [recorder]
        requests = [GenerationRequest(prompt_ids=p, max_new_tokens=settings.max_new_tokens, temperature=t,
                                      top_k=0, top_p=1.0, seed=settings.seed + i) for i, p in enumerate(ids)]
        outputs = engine.generate(requests)
        order = {o.request_id: i for i, o in enumerate(outputs)}  # prompt index of each request
        fit = recorder.data(lambda rid: order[rid] % 2 == 0)
        held = recorder.data(lambda rid: order[rid] % 2 == 1)
        calibrator = host.create_calibrator(settings.calibrator, dict(settings.extra))
        fit_report = calibrator.fit(fit)
        if hasattr(calibrator, "fitted_for"):  # the engine refuses it for another drafter or γ
            calibrator.fitted_for = {**drafter_identity(recording, engine.drafter), "temperature": t}
        before = calibration_report(held)
        after = calibration_report(held, calibrator.apply(held.confidence))
        name = f"T{t:g}"
        path = out / f"calibrator-{name}.safetensors"
        calibrator.save(str(path))
        reliability_diagram({"calibrator": settings.calibrator, "before": before, "after": after},
                            out / f"reliability-{name}.png", per_position=True,
                            title=f"held-out rounds, T = {t:g}")
        result["temperatures"][f"{t:g}"] = {
            "rounds_fit": int(fit.confidence.shape[0]), "rounds_held_out": int(held.confidence.shape[0]),
            "calibrator_file": str(path), "fit": _params(fit_report), "held_out": {"before": before, "after": after},
        }
    engine.round_observers.clear()
    (out / "calibration.json").write_text(json.dumps(result, indent=2, allow_nan=True))
    return result


def _params(report: dict[str, Any]) -> dict[str, Any]:
    """The fitted parameters of a calibrator's fit report (its own before/after are on the fit rounds)."""
    return {k: v for k, v in report.items() if k not in ("before", "after")}


def calibration_table(result: dict[str, Any]) -> str:
    """Per temperature and position, on held-out rounds: ECE, AUROC and Brier of the cumulative
    survival before → after."""
    from specforge.evaluation.report import fmt

    # The floor: what a perfectly calibrated predictor with the calibrated predictions would score
    # on this many rounds (metrics.ece_floor) — an ECE at its floor is as good as this n can show.
    lines = ["| T | k | rounds | ECE before → after (floor) | AUROC before → after | Brier before → after |",
             "|---|---|---|---|---|---|"]
    for t, r in result["temperatures"].items():
        b, a = r["held_out"]["before"], r["held_out"]["after"]
        for pb, pa in zip(b["positions"], a["positions"]):
            lines.append(f"| {t} | {pb['k']} | {pb['n']} | {fmt(pb['ece'], '.3f')} → {fmt(pa['ece'], '.3f')} "
                         f"({fmt(pa.get('ece_floor'), '.3f')}) | "
                         f"{fmt(pb.get('auroc'), '.3f')} → {fmt(pa.get('auroc'), '.3f')} | "
                         f"{fmt(pb.get('brier'), '.3f')} → {fmt(pa.get('brier'), '.3f')} |")
        ob, oa = b["overall"], a["overall"]
        lines.append(f"| {t} | all | {ob.get('n', '')} | {fmt(ob['ece'], '.3f')} → {fmt(oa['ece'], '.3f')} "
                     f"({fmt(oa.get('ece_floor'), '.3f')}) | "
                     f"{fmt(ob.get('auroc'), '.3f')} → {fmt(oa.get('auroc'), '.3f')} | "
                     f"{fmt(ob.get('brier'), '.3f')} → {fmt(oa.get('brier'), '.3f')} |")
    return "\n".join(lines)
