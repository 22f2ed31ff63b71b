"""vLLM CPU as the black-box tier draws from it.  Runs INSIDE the vLLM venv (``.venv-vllm``), as a
persistent subprocess of :class:`specforge_conformance.engines.VllmEngine`; it imports vLLM, the
standard library and the environment defaults of :mod:`specforge.peers.vllm_runner` (a
standalone script too, read from this checkout) — never specforge itself.

Protocol: JSON lines.  The first line read configures the engine::

    {"model": "<HF dir>", "speculative_config": {...} | null, "logprobs_mode": "raw_logprobs",
     "max_logprobs": 20}

and is answered ``{"ok": true, "vllm": "<version>", "startup_s": …}`` once ``vllm.LLM`` is up.
Every later line is one set of requests::

    {"prompt": [ids], "max_tokens": 4, "temperature": 1.0, "seeds": [..], "logprobs": 20}

(``temperature`` may also be a list, one per seed: requests at different temperatures in one batch)

answered with ``{"tokens": [[..]], "laws": [[[ids, probs], ...]], "drafted": D, "accepted": A}``:
per request and position the top ``logprobs`` tokens of the law vLLM reports (raw: the target's at
T = 1; processed: after temperature) — only tokens of rank ≤ ``logprobs``, so that which tokens are
listed never depends on the token drawn.  Pure temperature sampling: top-k 0, top-p 1, min-p 0, no
penalties, ``ignore_eos`` (vLLM keeps EOS in the law and goes on after it).  An error is a line
``{"error": "..."}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vllm_runner.py, its sibling
from vllm_runner import _ENV_DEFAULTS, _spec_counters  # noqa: E402 - after the path it lives on

# 16 sequences of at most 256 tokens need under 0.1 GiB of KV; the bench's 4 GiB per process,
# times the up to four processes a conformance case keeps alive (two law modes, speculation on
# and off), took 24 GB and made vLLM refuse to start on a 23 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
for _k, _v in _ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)


def _reply(out, doc: dict) -> None:
    out.write(json.dumps(doc) + "\n")
    out.flush()


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever vLLM prints stays off the protocol
    config = json.loads(sys.stdin.readline())
    try:
        import vllm
        from vllm import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(model=config["model"], dtype="bfloat16", seed=0, generation_config="vllm", disable_log_stats=False,
                  max_model_len=256, max_num_seqs=16, enable_prefix_caching=True,
                  speculative_config=config.get("speculative_config"), logprobs_mode=config["logprobs_mode"],
                  max_logprobs=int(config["max_logprobs"]))
        _reply(out, {"ok": True, "vllm": vllm.__version__, "startup_s": time.perf_counter() - start})
    except Exception as exc:  # noqa: BLE001 - said on the protocol, then exit
        _reply(out, {"error": f"vLLM did not start: {exc!r}\n{traceback.format_exc()[-2000:]}"})
        return 1
    for line in sys.stdin:
        try:
            req = json.loads(line)
            k = int(req["logprobs"])
            # one temperature for every request, or one each (a mixed arm: one batch, several settings)
            temps = req["temperature"]
            temps = temps if isinstance(temps, list) else [temps] * len(req["seeds"])
            params = [SamplingParams(temperature=float(t), top_k=0, top_p=1.0, min_p=0.0,
                                     presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                     max_tokens=int(req["max_tokens"]), ignore_eos=True, seed=int(s), logprobs=k)
                      for s, t in zip(req["seeds"], temps)]
            before = _spec_counters(llm)
            results = llm.generate([{"prompt_token_ids": req["prompt"]}] * len(params), params, use_tqdm=False)
            after = _spec_counters(llm)
            tokens, laws = [], []
            for r in results:
                o = r.outputs[0]
                tokens.append(list(o.token_ids))
                per = []
                for entry in o.logprobs or []:
                    top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None
                                  and lp.rank <= k), key=lambda x: x[0])
                    per.append([[t for _, t, _ in top], [math.exp(lp) for _, _, lp in top]])
                laws.append(per)
            _reply(out, {"tokens": tokens, "laws": laws,
                         "drafted": int(after.get("draft_tokens", 0) - before.get("draft_tokens", 0)) if after else None,
                         "accepted": int(after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0))
                         if after else None})
        except Exception as exc:  # noqa: BLE001
            _reply(out, {"error": f"{exc!r}\n{traceback.format_exc()[-2000:]}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
