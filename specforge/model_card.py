"""``specforge export --to hf``: a drafter checkpoint as a Hugging Face-style folder with a model
card (docs/interop.md).

The folder is the checkpoint itself — ``config.json`` and ``model.safetensors`` are already what
``huggingface_hub`` uploads and ``safetensors`` reads — each file checked against the sha256 its
``config.json`` records, plus a ``README.md`` whose YAML front matter the Hub reads
(``library_name``, ``base_model``, ``tags``) and whose body names the target, the training data,
the τ table of an evaluation and the conformance result.  Measurements are never invented: a card
without ``--eval`` or ``--conformance`` says which command would measure them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specforge.files import file_problem
from specforge.toolkit.formats import InteropError

__all__ = ["BASE_MODELS", "export_hf", "model_card"]

#: Embedded target names -> the Hub repository of the model they are (the card's ``base_model``).
BASE_MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InteropError(f"{path}: missing ({what})") from None
    except ValueError as exc:
        raise InteropError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InteropError(f"{path}: not a JSON object ({what})")
    return doc


def _absent(result: dict[str, Any] | None, source: str | None, command: str, key: str) -> bool:
    """Whether a section's result was not given; one given must be ``command``'s (hold ``key``)."""
    if result is not None and key not in result:
        raise InteropError(f"{source}: not a `{command}` result (no '{key}')")
    return result is None


def _tau_section(evaluation: dict[str, Any] | None, source: str | None) -> list[str]:
    # Imported on the call: the evaluation package loads its runner and the engine, which a card
    # without a τ table — and every other export — never needs.
    from specforge.evaluation.report import table

    if _absent(evaluation, source, "specforge eval", "results"):
        return ["Not measured for this card: `specforge eval --config <pipeline serving this drafter> --out DIR` "
                "writes the result; pass it with `--eval DIR/eval.json`."]
    settings = evaluation.get("settings", {})
    return [f"From `{Path(source).name}`: {settings.get('prompts', '?')} prompts per set, up to "
            f"{settings.get('max_new_tokens', '?')} new tokens, concurrency {settings.get('concurrency', 1)}; τ is the "
            "mean number of tokens a round commits, acc@k the acceptance at position k given k−1 accepted.",
            "", "```", table(evaluation), "```"]


def _conformance_section(result: dict[str, Any] | None, source: str | None) -> list[str]:
    if _absent(result, source, "specforge conformance", "passed"):
        return ["Not run for this card: `specforge conformance --plugin <name> --out conformance.json`; pass the "
                "file with `--conformance`."]
    cases = result.get("combinations") or []
    seeds = result.get("seeds")
    return [f"`specforge conformance` ({result.get('tier', '?')} tier, level α = {result.get('alpha', '?')} per case"
            + (f", {len(seeds)} seeds" if isinstance(seeds, list) else "")
            + f"): **{'passed' if result['passed'] else 'FAILED'}**"
            + (f" over {len(cases)} combinations" if cases else "") + "."]


def model_card(meta: dict[str, Any], evaluation: dict[str, Any] | None = None,
               conformance: dict[str, Any] | None = None, eval_source: str | None = None,
               conformance_source: str | None = None) -> str:
    """README.md of an exported drafter: Hub front matter, then what it is, how it was trained,
    its τ table and its conformance result (each only if measured)."""
    method, target = meta.get("method", "?"), meta.get("target")
    drafter = meta.get("drafter") or {}
    base = BASE_MODELS.get(str(target), target)
    front = ["---", "library_name: specforge"] + ([f"base_model: {base}"] if base else []) + [
        "tags:", "- speculative-decoding", f"- {method}", "- specforge", "---", ""]
    data = drafter.get("data")
    lines = [f"# {method} drafter for {base or 'an unrecorded target'}", "",
             f"A draft model for lossless speculative decoding of `{target}`, trained with specforge "
             f"({drafter.get('trained_steps', '?')} steps; γ = {drafter.get('gamma', '?')}).", "",
             "## Training data", "",
             f"```json\n{json.dumps(data, indent=2)}\n```" if data else "Not recorded in the checkpoint.", "",
             "## Use", "",
             f"- specforge: `specforge generate --config default drafter.name={method} "
             "drafter.checkpoint=<this folder> \"…\"`",
             "- other engines: `specforge export <this folder> --to FORMAT --out DIR` (the layouts: "
             "`specforge plugins --json`, `checkpoint_formats`)", "",
             "## Acceptance", "", *_tau_section(evaluation, eval_source), "",
             "## Conformance", "", *_conformance_section(conformance, conformance_source), "",
             "## Files", "", "`config.json` (architecture, target shape, provenance) and `model.safetensors`; "
             "the target's embedding and LM head are not included — the drafter shares the target's.", ""]
    return "\n".join(front + lines)


def export_hf(source: Path, out: Path, evaluation: str | Path | None = None,
              conformance: str | Path | None = None) -> list[str]:
    """Copy the checkpoint ``source`` (its files checked against their recorded sha256) into the
    empty folder ``out`` and write its model card."""
    meta = _read_json(source / "config.json", "a specforge drafter checkpoint")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise InteropError(f"{source / 'config.json'}: records no weight files; not a specforge drafter checkpoint")
    for name, record in files.items():
        problem = file_problem(source / name, record, str(source / "config.json"), name)
        if problem:
            raise InteropError(f"{source}: {problem}")
    ev = None if evaluation is None else _read_json(Path(evaluation), "a `specforge eval` result")
    conf = None if conformance is None else _read_json(Path(conformance), "a `specforge conformance` result")
    card = model_card(meta, ev, conf, None if evaluation is None else str(evaluation),
                      None if conformance is None else str(conformance))
    for name in ["config.json", *files]:
        shutil.copy2(source / name, out / name)
    (out / "README.md").write_text(card)
    missing = [what for what, doc in (("τ table", ev), ("conformance result", conf)) if not doc]
    return [f"the model card has no {' and no '.join(missing)} (pass --eval / --conformance)"] if missing else []
