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
4. *Online* (``online``).  The fit rounds are replayed, in the order the engine verified them, into
   a fresh online calibrator (``online-sts``: identity until it has seen enough) — exactly what it
   observes while serving — and its ECE on the held-out rounds is traced against rounds seen,
   beside the offline fit's.  Then a shift of the prompt mix: the code sets' rounds first, the
   chat sets' after, scored on held-out chat rounds.  ``online.png`` draws both curves.
5. *Replay.*  The rounds are saved (``rounds-T<t>.safetensors``, :func:`save_rounds`); ``--replay``
   runs steps 2–4 on them again without decoding.
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

__all__ = ["CalibrateSettings", "RoundRecorder", "calibrate", "calibration_table", "load_rounds", "online_plot",
           "online_replay", "replay", "save_rounds"]


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
    online: str | None = None  # an online calibrator to replay the rounds into (e.g. online-sts)
    online_extra: dict[str, Any] = field(default_factory=dict)  # its config keys (window, refit_every, …)
    online_every: int = 64  # rounds between the points of its curves
    tolerance: float = 0.005  # "reached": pooled ECE within this of the offline fit's, from then on

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
    from specforge.engine.bind import drafter_identity
    from specforge.evalsets import apply_chat_template
    from specforge.plugins import get_host
    from specforge.engine import load_pipeline_target

    if pipeline.component("drafter") is None:
        from specforge.errors import ConfigError

        raise ConfigError(["drafter.name: the pipeline has no drafter, so there are no rounds to calibrate on"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = get_host()
    # Every drafted token verified, confidences raw: every position of every round is observed.
    recording = load_pipeline(["default"], sections={**pipeline.to_dict(), "scheduler": {"name": "fixed"},
                                                     "calibrator": {"name": "identity"}})
    target = target or load_pipeline_target(pipeline)
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
        sets = {o.request_id: prompts[order[o.request_id]].dataset for o in outputs}
        fitted_for = {**drafter_identity(recording, engine.drafter), "temperature": t}
        save_rounds(out / f"rounds-T{t:g}.safetensors", recorder.outcomes, order, sets, fitted_for)
        result["temperatures"][f"{t:g}"] = _fit_and_report(recorder.outcomes, order, sets, t, settings, out, host,
                                                            fitted_for)
    engine.round_observers.clear()
    (out / "calibration.json").write_text(json.dumps(result, indent=2, allow_nan=True))
    return result


def _fit_and_report(outcomes: Sequence[RoundOutcome], order: dict[int, int], sets: dict[int, str], t: float,
                    settings: CalibrateSettings, out: Path, host: Any, fitted_for: dict[str, Any] | None) -> dict[str, Any]:
    """Split one temperature's rounds by prompt, fit, save, score, plot (and replay online)."""
    from specforge.metrics import calibration_report
    from specforge.plots import reliability_diagram

    recorder = RoundRecorder()
    recorder.outcomes = list(outcomes)
    fit = recorder.data(lambda rid: order[rid] % 2 == 0)
    held = recorder.data(lambda rid: order[rid] % 2 == 1)
    calibrator = host.create_calibrator(settings.calibrator, dict(settings.extra))
    fit_report = calibrator.fit(fit)
    if hasattr(calibrator, "fitted_for"):  # the engine refuses it for another drafter or γ
        calibrator.fitted_for = fitted_for
    before = calibration_report(held)
    after = calibration_report(held, calibrator.apply(held.confidence))
    name = f"T{t:g}"
    path = out / f"calibrator-{name}.safetensors"
    calibrator.save(str(path))
    reliability_diagram({"calibrator": settings.calibrator, "before": before, "after": after},
                        out / f"reliability-{name}.png", per_position=True, title=f"held-out rounds, T = {t:g}")
    result = {"rounds_fit": int(fit.confidence.shape[0]), "rounds_held_out": int(held.confidence.shape[0]),
              "calibrator_file": str(path), "fit": _params(fit_report), "held_out": {"before": before, "after": after}}
    if settings.online:
        online = online_replay(outcomes, order, sets, settings, host)
        result["online"] = online
        online_plot(online, out / f"online-{name}.png", title=f"{settings.online}, T = {t:g}")
    return result


def save_rounds(path: Path, outcomes: Sequence[RoundOutcome], order: dict[int, int], sets: dict[int, str],
                fitted_for: dict[str, Any]) -> Path:
    """The recorded rounds, one request's round per row in the engine's order, with each row's
    prompt index and each prompt's set: ``specforge calibrate --replay`` fits and replays them
    again (other calibrators, other online settings) without decoding."""
    from safetensors.torch import save_file

    from specforge.files import replace_atomically

    rows = _single_rounds(outcomes, lambda rid: True)
    width = max((r.confidence.shape[1] for r in rows), default=0)
    conf = torch.full((len(rows), width), 0.5, dtype=torch.float64)
    for j, r in enumerate(rows):
        conf[j, : r.confidence.shape[1]] = r.confidence[0].to(torch.float64)
    tensors = {"confidence": conf,
               **{k: torch.cat([getattr(r, k) for r in rows]).long() if rows else torch.zeros(0, dtype=torch.long)
                  for k in ("available", "verified", "accepted")},
               "temperature": torch.cat([r.temperature for r in rows]).double() if rows else torch.zeros(0),
               "prompt": torch.tensor([order[r.request_ids[0]] for r in rows], dtype=torch.long)}
    datasets = {str(order[rid]): name for rid, name in sets.items()}
    meta = {"format": "specforge-rounds", "datasets": json.dumps(datasets), "fitted_for": json.dumps(fitted_for)}
    with replace_atomically(path) as tmp:  # a killed run leaves no half-written rounds file
        save_file(tensors, str(tmp), metadata=meta)
    return path


def load_rounds(path: str | Path) -> tuple[list[RoundOutcome], dict[int, int], dict[int, str], dict[str, Any]]:
    """What :func:`save_rounds` wrote: the rounds (request id = prompt index), the prompt order, each
    prompt's set and what they were recorded with."""
    from safetensors import SafetensorError, safe_open

    from specforge.errors import ConfigError

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise ConfigError([f"--replay {path}: not a rounds file ({exc})"]) from None
    if meta.get("format") != "specforge-rounds":
        raise ConfigError([f"--replay {path}: not a rounds file written by specforge calibrate"])
    rows = [RoundOutcome([int(p)], t["confidence"][j:j + 1], t["available"][j:j + 1], t["verified"][j:j + 1],
                         t["accepted"][j:j + 1], t["temperature"][j:j + 1]) for j, p in enumerate(t["prompt"].tolist())]
    sets = {int(k): v for k, v in json.loads(meta["datasets"]).items()}
    return rows, {p: p for p in sets}, sets, json.loads(meta["fitted_for"])


def replay(paths: Sequence[str | Path], settings: CalibrateSettings, out_dir: str | Path) -> dict[str, Any]:
    """Fit, score (and replay online) the rounds of earlier ``specforge calibrate`` runs, without decoding."""
    from specforge.plugins import get_host

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    host = get_host()
    result: dict[str, Any] = {"replayed": [str(p) for p in paths], "settings": settings.to_dict(), "temperatures": {}}
    for path in paths:
        rows, order, sets, fitted_for = load_rounds(path)
        t = float(fitted_for.get("temperature", rows[0].temperature[0] if rows else 0.0))
        result["temperatures"][f"{t:g}"] = _fit_and_report(rows, order, sets, t, settings, out, host, fitted_for)
    (out / "calibration.json").write_text(json.dumps(result, indent=2, allow_nan=True))
    return result


# Which eval sets are code and which are chat, for the shift of the prompt mix.
CODE_SETS, CHAT_SETS = ("humaneval", "mbpp"), ("mt-bench",)


def _single_rounds(outcomes: Sequence[RoundOutcome], keep) -> list[RoundOutcome]:
    """The recorded rounds one request at a time, in the engine's order, of the requests ``keep`` accepts."""
    return [RoundOutcome([rid], o.confidence[i:i + 1], o.available[i:i + 1], o.verified[i:i + 1],
                         o.accepted[i:i + 1], o.temperature[i:i + 1])
            for o in outcomes for i, rid in enumerate(o.request_ids) if keep(rid) and int(o.available[i]) > 0]


def _data(rounds: Sequence[RoundOutcome]) -> CalibrationData:
    recorder = RoundRecorder()
    recorder.outcomes = list(rounds)
    return recorder.data()


def _pooled_ece(calibrator: Any, held: CalibrationData) -> float:
    from specforge.metrics import calibration_report

    return calibration_report(held, calibrator.apply(held.confidence))["overall"]["ece"]


def _trace(calibrator: Any, stream: Sequence[RoundOutcome], held: CalibrationData, every: int) -> list[list[float]]:
    """``[rounds seen, pooled held-out ECE]`` every ``every`` rounds while ``calibrator`` observes ``stream``."""
    points = [[0, _pooled_ece(calibrator, held)]]
    for n, outcome in enumerate(stream, 1):
        calibrator.observe(outcome)
        if n % every == 0 or n == len(stream):
            points.append([n, _pooled_ece(calibrator, held)])
    return points


def _reached(points: list[list[float]], reference: float, tolerance: float, start: int = 0) -> int | None:
    """Rounds after ``start`` from which the curve stays within ``tolerance`` of ``reference``."""
    after = [p for p in points if p[0] >= start]
    for i, (n, _) in enumerate(after):
        if all(e <= reference + tolerance for _, e in after[i:]):
            return int(n - start)
    return None


def online_replay(outcomes: Sequence[RoundOutcome], order: dict[int, int], sets: dict[int, str],
                  settings: CalibrateSettings, host: Any) -> dict[str, Any]:
    """Replay the fit rounds into fresh online calibrators (see the module docstring, step 4)."""
    def fresh() -> Any:
        calibrator = host.create_calibrator(settings.online, dict(settings.online_extra))
        if not hasattr(calibrator, "observe"):
            raise ValueError(f"calibrator {settings.online!r} does not observe rounds; it cannot recalibrate online")
        return calibrator

    def offline(rounds: Sequence[RoundOutcome]) -> Any:
        calibrator = host.create_calibrator(settings.calibrator, dict(settings.extra))
        calibrator.fit(_data(rounds))
        return calibrator

    fit_rounds = _single_rounds(outcomes, lambda rid: order[rid] % 2 == 0)
    held = _data(_single_rounds(outcomes, lambda rid: order[rid] % 2 == 1))
    reference = _pooled_ece(offline(fit_rounds), held)
    calibrator = fresh()
    curve = _trace(calibrator, fit_rounds, held, settings.online_every)
    out: dict[str, Any] = {
        "calibrator": settings.online, "state": calibrator.state(), "tolerance": settings.tolerance,
        "mixed": {"rounds": len(fit_rounds), "offline_ece": reference, "curve": curve,
                  "reached_after": _reached(curve, reference, settings.tolerance)},
    }
    code = [r for r in fit_rounds if sets[r.request_ids[0]] in CODE_SETS]
    chat = [r for r in fit_rounds if sets[r.request_ids[0]] in CHAT_SETS]
    if code and chat:
        chat_held = _data(_single_rounds(outcomes, lambda rid: order[rid] % 2 == 1 and sets[rid] in CHAT_SETS))
        chat_reference = _pooled_ece(offline(chat), chat_held)
        shifted = _trace(fresh(), code + chat, chat_held, settings.online_every)
        at_switch = next(e for n, e in reversed(shifted) if n <= len(code))
        out["shift"] = {"from": list(CODE_SETS), "to": list(CHAT_SETS), "switch": len(code), "rounds": len(code + chat),
                        "offline_ece": chat_reference, "ece_at_switch": at_switch, "curve": shifted,
                        "recovered_after": _reached(shifted, chat_reference, settings.tolerance, start=len(code))}
    return out


def online_plot(online: dict[str, Any], path: Path, title: str) -> Path:
    """Pooled held-out ECE against rounds observed: from identity on the mixed stream, and across
    the code → chat shift, each with its offline fit as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specforge.plots import save_figure

    parts = [("mixed", "every set, in serving order")] + ([("shift", "code sets, then chat")] if "shift" in online else [])
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], parts):
        part = online[key]
        n, e = zip(*part["curve"])
        ax.plot(n, e, marker=".", label=f"{online['calibrator']} (held-out ECE)")
        ax.axhline(part["offline_ece"], ls="--", color="gray", label="offline fit")
        if key == "shift":
            ax.axvline(part["switch"], color="red", lw=0.8, label="prompt mix shifts")
        ax.set_xlabel("rounds observed")
        ax.set_ylabel("ECE of cumulative survival")
        ax.set_title(label)
        ax.legend(fontsize=7)
    return save_figure(fig, path, title=title)


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
    for t, r in result["temperatures"].items():
        online = r.get("online")
        if online is None:
            continue
        m = online["mixed"]
        lines.append(f"\nT = {t}, {online['calibrator']} from identity over {m['rounds']} rounds in serving order: "
                     f"held-out ECE {fmt(m['curve'][-1][1], '.3f')} (offline fit {fmt(m['offline_ece'], '.3f')}); within "
                     f"{online['tolerance']:g} of it after {m['reached_after'] if m['reached_after'] is not None else 'never'} rounds")
        if "shift" in online:
            sh = online["shift"]
            lines.append(f"T = {t}, shift {'+'.join(sh['from'])} → {'+'.join(sh['to'])} after {sh['switch']} rounds: "
                         f"chat ECE {fmt(sh['ece_at_switch'], '.3f')} at the switch, {fmt(sh['curve'][-1][1], '.3f')} at "
                         f"the end (offline chat fit {fmt(sh['offline_ece'], '.3f')}); recovered after "
                         f"{sh['recovered_after'] if sh['recovered_after'] is not None else 'never'} rounds")
    return "\n".join(lines)
