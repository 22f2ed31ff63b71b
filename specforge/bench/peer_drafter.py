"""A drafter trained here, served by another engine, beside the same drafter in specforge's engine.

The benches ``specforge bench vllm-drafter`` and ``bench llamacpp-drafter`` are one measurement
with two peers (:class:`~specforge.peers.drafter_peer.Peer`, one sibling module each in :mod:`specforge.peers`): the drafter is exported in the peer's
layout with ``specforge export`` and the peer loads that file or folder itself.  Both systems
decode the same chat-templated prompts of the eval sets greedily, EOS ignored, ``max_new_tokens``
each, one request at a time, plainly and with the drafter (γ = the drafter's).  Three checks:

a. **Lossless in the peer.**  At T = 0 the peer's tokens with the drafter equal its plain tokens,
   prompt by prompt (the first differing position is reported otherwise).
b. **Same acceptance.**  The peer's own acceptance statistic against the same statistic of ours
   over the same prompts, within ``tolerance`` (10 %) when the peer runs the drafter as it was
   trained — per eval set where the peer reports per request.  Only near-ties can make the two
   greedy paths, and hence the counts, differ.
c. **Speedups**, each system over its own plain decoding in the same run.

Speeds are ratios within one system; the peer runs after specforge's arms, on the same cores.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from specforge.bench.runner import Report, add_output_arguments, bench_command
from specforge.errors import ConfigError
from specforge.peers.drafter_peer import Peer, PeerDrafterSettings, PeerRun
from specforge.peers.records import TEMPERATURE
from specforge.peers.vllm_drafter import VllmDrafterSettings, VllmPeer
from specforge.peers.llamacpp_drafter import LlamaCppPeer

__all__ = ["ACCEPTANCE", "COMMANDS", "add_peer_arguments", "passed", "run_llamacpp_drafter", "run_peer_drafter",
           "run_vllm_drafter", "serving_pipeline", "settings_from", "table"]

#: The acceptance statistics a peer may report, and how ours is computed in the same definition
#: from pooled :class:`~specforge.acceptance.AcceptanceCounts`.
ACCEPTANCE = {
    # 1 + accepted draft tokens per drafting round (vLLM's mean acceptance length)
    "mean acceptance length": lambda c: c.tau,
    # accepted / drafted tokens (llama.cpp's ``accept`` line and ``draft_n_accepted / draft_n``)
    "acceptance rate": lambda c: c.accepted / c.verified if c.verified else float("nan"),
}


def serving_pipeline(drafter_dir: Path, methods: Sequence[str], overrides: Sequence[str],
                     who: str = "this bench") -> tuple[str, Any]:
    """``(method, pipeline)``: the engine's default pipeline (every draft verified whole, as the
    peers do) serving the drafter checkpoint ``drafter_dir`` as it was trained — with the
    correction and confidence heads its checkpoint names (a block drafter's config.json; the
    peers run them from the exported file too) — and ``overrides``.  A method outside
    ``methods`` is refused, naming ``who`` serves which."""
    import json

    from specforge.config import load_pipeline

    try:
        meta = json.loads((drafter_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{drafter_dir}: not a specforge drafter checkpoint ({exc})"]) from None
    method = meta.get("method") if isinstance(meta, dict) else None
    if method not in methods:
        raise ConfigError([f"{drafter_dir}: a {method!r} drafter; {who} serves {', '.join(methods)}"])
    sections: dict[str, Any] = {"drafter": {"name": method, "checkpoint": str(drafter_dir)}}
    for key, slot in (("head", "correction_head"), ("confidence", "confidence")):
        trained = meta.get(key)
        if isinstance(trained, dict) and trained.get("name") not in (None, "none"):
            options = trained.get("config") or {}
            sections[slot] = {"name": trained["name"],
                              **{k: options[k] for k in ("rank", "embedding") if k in options}}
    return method, load_pipeline(["default"], list(overrides), sections=sections)


def _decode(engines: dict[str, Any], prompt_ids: list[list[int]], max_new_tokens: int,
            trials: int) -> dict[str, tuple[list[Any], float]]:
    """Every prompt on every engine, greedy, EOS ignored, one at a time (the engines' batch is 1):
    an untimed warm-up, then ``trials`` interleaved trials; the fastest one's outputs and seconds."""
    from specforge.engine import GenerationRequest

    def requests(n: int, ids: list[list[int]]) -> list[Any]:
        # the benches' greedy decoding: check (a) compares the peer's tokens with the drafter to its plain ones
        return [GenerationRequest(prompt_ids=p, max_new_tokens=n, temperature=TEMPERATURE, ignore_eos=True)
                for p in ids]

    for engine in engines.values():
        engine.generate(requests(8, prompt_ids[:1]))
    best: dict[str, tuple[list[Any], float]] = {}
    for _ in range(trials):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs = engine.generate(requests(max_new_tokens, prompt_ids))
            seconds = time.perf_counter() - t0
            failed = [o.error for o in outs if o.error]
            if failed:
                raise RuntimeError(f"specforge's engine ({name}) failed a request: {failed[0]}")
            if name not in best or seconds < best[name][1]:
                best[name] = (outs, seconds)
    return best


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _rate(outs: Sequence[Any], seconds: float) -> float:
    return sum(len(o.token_ids) for o in outs) / seconds if seconds > 0 else float("nan")


def run_peer_drafter(peer: Peer, drafter_dir: str | Path, settings: PeerDrafterSettings, out: str | Path,
                     progress: bool = True) -> dict[str, Any]:
    """Export ``drafter_dir`` for ``peer`` under ``out``, decode with both systems, check (a)–(c)."""
    from specforge.acceptance import AcceptanceCounts
    from specforge.config import EngineConfig
    from specforge.engine import Engine
    from specforge.evalsets import apply_chat_template, select_prompts
    from specforge.interop import drafter_directory, export_checkpoint
    from specforge.machine import machine
    from specforge.engine import load_pipeline_target

    drafter_dir, out = drafter_directory(drafter_dir), Path(out)
    method, pipeline = serving_pipeline(drafter_dir, list(peer.methods),
                                        [*peer.pipeline_overrides, *settings.overrides], peer.name)
    version = peer.check()  # a missing peer says how to install it, before any work
    export = peer.export_path(method, out)
    if export.is_dir():
        shutil.rmtree(export)  # our own output of an earlier run
    notes = export_checkpoint(drafter_dir, peer.layout, export)

    target = load_pipeline_target(pipeline)
    names, prompt_ids = [], []
    for name in settings.datasets:
        for p in select_prompts(name, settings.prompts, settings.eval_dir):
            names.append(p.dataset)
            prompt_ids.append(apply_chat_template(target.tokenizer, p.text))
    limits = EngineConfig(max_batch=1, max_context=pipeline.engine.max_context)
    spec = Engine.from_pipeline(replace(pipeline, engine=limits), target)
    gamma = int(spec.drafter.gamma)
    plain = Engine(target, pipeline.component("verifier").create(), engine=limits)
    say = (lambda m: print(m, file=sys.stderr)) if progress else (lambda m: None)
    say(f"specforge ({target.backend.name} backend): {len(prompt_ids)} prompts, plain and {method} (γ = {gamma})")
    runs = _decode({"plain": plain, method: spec}, prompt_ids, settings.max_new_tokens, settings.trials)
    (ours_plain, plain_s), (ours_spec, spec_s) = runs["plain"], runs[method]
    statistic = ACCEPTANCE[peer.acceptance]
    pooled = AcceptanceCounts.pooled(o.stats for o in ours_spec)

    say(f"{peer.name} {version}: plain and {method} from {export}")
    theirs = peer.run(export, method, gamma, prompt_ids, settings, out, progress, pipeline.target.model)
    result: dict[str, Any] = {
        "machine": machine(), "peer": peer.name, "peer_version": version, "drafter": str(drafter_dir),
        "method": method, "gamma": gamma, "export": str(export), "export_notes": notes,
        "settings": {**asdict(settings), "datasets": list(settings.datasets), "overrides": list(settings.overrides)},
        "backend": target.backend.name, "acceptance_statistic": peer.acceptance, "prompts": names,
        "specforge": {"plain_tok_s": _rate(ours_plain, plain_s), "drafter_tok_s": _rate(ours_spec, spec_s),
                      "rounds": pooled.rounds, "acceptance": statistic(pooled),
                      "acceptance_length": pooled.tau, "acceptance_by_position": pooled.conditional_acceptance(),
                      "identical_to_plain": sum(a.token_ids == b.token_ids for a, b in zip(ours_spec, ours_plain))},
    }
    ours = result["specforge"]
    ours["speedup"] = ours["drafter_tok_s"] / ours["plain_tok_s"]
    if isinstance(theirs, dict):
        result["checks"] = {"peer_failed": theirs}
        return result
    diffs = {i: _first_difference(theirs.drafter_tokens[i], theirs.plain_tokens[i]) for i in range(len(prompt_ids))}
    ratio = theirs.acceptance / ours["acceptance"]
    result["theirs"] = {**{k: v for k, v in asdict(theirs).items() if not k.endswith("_tokens")},
                        "speedup": theirs.drafter_tok_s / theirs.plain_tok_s}
    result["checks"] = {
        "lossless_in_peer": {"identical": sum(d is None for d in diffs.values()), "prompts": len(diffs),
                             "first_difference": {names[i] + f"#{i}": d for i, d in diffs.items() if d is not None}},
        "same_plain_tokens": sum(theirs.plain_tokens[i] == o.token_ids for i, o in enumerate(ours_plain)),
        "acceptance_ratio": ratio, "acceptance_within_tolerance": abs(ratio - 1) <= settings.tolerance,
        "per_set": _per_set(names, ours_spec, theirs, statistic),
    }
    return result


def _per_set(names: list[str], ours: Sequence[Any], theirs: PeerRun, statistic: Any) -> dict[str, Any]:
    """The acceptance rate of each eval set on both sides, where the peer reports per request."""
    from specforge.acceptance import AcceptanceCounts

    if theirs.per_prompt is None or statistic is not ACCEPTANCE["acceptance rate"]:
        return {}
    rows = {}
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        mine = statistic(AcceptanceCounts.pooled(ours[i].stats for i in idx))
        drafted = sum(theirs.per_prompt[i][0] for i in idx)
        peer = sum(theirs.per_prompt[i][1] for i in idx) / drafted if drafted else float("nan")
        rows[name] = {"specforge": mine, "peer": peer, "ratio": peer / mine if mine else float("nan")}
    return rows


def passed(result: dict[str, Any]) -> bool:
    """Checks (a) and (b) hold."""
    c = result.get("checks", {})
    lossless = c.get("lossless_in_peer", {})
    return bool(lossless) and lossless["identical"] == lossless["prompts"] and bool(c.get("acceptance_within_tolerance"))


def table(result: dict[str, Any]) -> str:
    """Markdown: the two systems side by side, the checks, the acceptance per eval set."""
    ours, c, stat = result["specforge"], result.get("checks", {}), result["acceptance_statistic"]
    s = result["settings"]
    lines = [f"{result['method']} drafter {result['drafter']} (γ = {result['gamma']}), {len(result['prompts'])} prompts × "
             f"{s['max_new_tokens']} tokens, greedy, c = 1, specforge on its {result['backend']} backend — "
             f"{result['machine'].get('cpu')}", ""]
    if "peer_failed" in c:
        return "\n".join(lines + [f"{result['peer']} failed: {c['peer_failed']}"])
    v = result["theirs"]
    lines += [f"| system | plain tok/s | with drafter tok/s | speedup | {stat} |",
              "|---|---:|---:|---:|---:|",
              f"| specforge | {ours['plain_tok_s']:.1f} | {ours['drafter_tok_s']:.1f} | {ours['speedup']:.2f}× | "
              f"{ours['acceptance']:.3f} |",
              f"| {result['peer']} {result['peer_version']} | {v['plain_tok_s']:.1f} | {v['drafter_tok_s']:.1f} | "
              f"{v['speedup']:.2f}× | {v['acceptance']:.3f} |", ""]
    if c.get("per_set"):
        lines += [f"| eval set | specforge {stat} | {result['peer']} {stat} | ratio |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {row['specforge']:.3f} | {row['peer']:.3f} | {row['ratio']:.3f} |"
                  for name, row in c["per_set"].items()]
        lines.append("")
    ll = c["lossless_in_peer"]
    lines += [f"- (a) {result['peer']} with the drafter = {result['peer']} plain, token for token: "
              f"{ll['identical']}/{ll['prompts']} prompts"
              + (f" (first differences: {ll['first_difference']})" if ll["first_difference"] else ""),
              f"- (b) {stat} {result['peer']} / specforge = {c['acceptance_ratio']:.3f} "
              f"({'within' if c['acceptance_within_tolerance'] else 'OUTSIDE'} ±{s['tolerance']:.0%})",
              f"- plain tokens identical across the two systems: {c['same_plain_tokens']}/{ll['prompts']} prompts; "
              f"specforge with the drafter = specforge plain: {ours['identical_to_plain']}/{ll['prompts']}"]
    lines += [f"- {result['peer']} ran: `{cmd}`" for cmd in v.get("commands", [])]
    lines.append(f"- result: {'PASSED' if passed(result) else 'FAILED'}")
    return "\n".join(lines)


def add_peer_arguments(p: argparse.ArgumentParser, d: PeerDrafterSettings) -> None:
    """The options both benches share (the drafter, the prompts, the tolerance, specforge's overrides)."""
    p.add_argument("drafter", metavar="DRAFTER", help="a specforge drafter checkpoint directory or shipped:NAME")
    p.add_argument("--datasets", nargs="+", default=list(d.datasets))
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per eval set")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--tolerance", type=float, default=d.tolerance,
                   help="largest relative difference of the two systems' acceptance statistic")
    p.add_argument("--eval-dir", default=None, metavar="DIR")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="pipeline overrides for specforge's side, e.g. target.backend=torch")


def settings_from(args: argparse.Namespace, cls: type[PeerDrafterSettings] = PeerDrafterSettings,
                  **more: Any) -> PeerDrafterSettings:
    return cls(datasets=args.datasets, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
               tolerance=args.tolerance, eval_dir=args.eval_dir, overrides=args.overrides, **more)


# -- the two benches ----------------------------------------------------------------------------


def run_vllm_drafter(drafter_dir: str | Path, settings: VllmDrafterSettings, out: str | Path,
                     progress: bool = True) -> dict[str, Any]:
    """Export ``drafter_dir`` for vLLM under ``out``, decode with both systems, check them."""
    return run_peer_drafter(VllmPeer(settings.dtype), drafter_dir, settings, out, progress)


def run_llamacpp_drafter(drafter_dir: str | Path, settings: PeerDrafterSettings, out: str | Path,
                         progress: bool = True) -> dict[str, Any]:
    """Export ``drafter_dir`` for llama.cpp under ``out``, decode with both systems, check them."""
    return run_peer_drafter(LlamaCppPeer(), drafter_dir, settings, out, progress)


REPORT = Report("bench.json", table, table_file="table.md")


def _vllm_arguments(p: argparse.ArgumentParser) -> None:
    d = VllmDrafterSettings()
    add_peer_arguments(p, d)
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                   help="both systems' dtype (bfloat16 rounds a γ+1-token verify pass differently from a one-token "
                        "step, so near-ties flip the greedy output)")
    add_output_arguments(p, "runs/bench-vllm-drafter")


def _measure_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """serve a drafter trained here with vLLM's CPU build (exported with `specforge export --to vllm`) and
    compare it with specforge's engine

    Exports DRAFTER_DIR in vLLM's layout, then decodes the same prompts greedily with vLLM (plain and
    with the drafter as its speculative model) and with specforge's engine (plain and with the
    drafter).  Checks that vLLM's output with the drafter equals its plain output token for token and
    that vLLM's mean acceptance length is within the tolerance of ours; reports both systems'
    speedups over their own plain decoding.  Needs vLLM's CPU build (`make vllm`).  Exit status 1
    when a check fails.
    """
    return run_vllm_drafter(args.drafter, settings_from(args, VllmDrafterSettings, dtype=args.dtype), args.out)


def _llamacpp_arguments(p: argparse.ArgumentParser) -> None:
    add_peer_arguments(p, PeerDrafterSettings())
    add_output_arguments(p, "runs/bench-llamacpp-drafter")


def _measure_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    """run a DSpark or DFlash drafter trained here in llama.cpp (exported with `specforge export --to llama.cpp`)
    and compare it with specforge's engine

    Exports DRAFTER (a checkpoint directory or shipped:NAME) as GGUF, then decodes the same prompts
    greedily with llama-server (plain, and with the drafter as its speculative draft) and with
    specforge's engine on its llama.cpp target backend (plain and with the drafter).  Checks that
    llama.cpp's output with the drafter equals its plain output token for token and that its
    acceptance rate is within the tolerance of ours (also per eval set); reports both systems'
    speedups over their own plain decoding.  Needs llama.cpp's tools (`make llama.cpp`).  Exit
    status 1 when a check fails.
    """
    return run_llamacpp_drafter(args.drafter, settings_from(args), args.out)


COMMANDS = [bench_command("vllm-drafter", _vllm_arguments, _measure_vllm, REPORT, passed=passed),
            bench_command("llamacpp-drafter", _llamacpp_arguments, _measure_llamacpp, REPORT, passed=passed)]
