"""Why llama.cpp with our drafter can leave its own plain greedy text at T = 0: a row's logits
depend on how many rows share the pass.

`specforge bench llamacpp-drafter shipped:smollm2-135m-instruct --prompts 4` (AMD EPYC, 2 threads)
found 10 of 12 prompts identical; humaneval #5 and #7 (the 2nd and 4th humaneval prompts) left
the plain text at positions 58 and 50.  This prints, at those positions, the top-2 logit margin of
the position computed alone and computed as the last of an 8-row pass (the shape of a verify pass
with γ = 7), and the largest logit difference between the two.

    python scripts/llamacpp_divergence.py
"""
import llama_cpp
import numpy as np

from specforge.evalsets import apply_chat_template, select_prompts
from specforge.runtime import load_target
from specforge.model_files import resolve_model

d, f = resolve_model("smollm2")
gguf = str(d / f)
tok = load_target("smollm2", dtype="float32", backend="torch").tokenizer
prompts = select_prompts(["humaneval"], 4)
llm = llama_cpp.Llama(model_path=gguf, n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn=True, n_threads=2,
                      logits_all=True, verbose=False)
for idx, pos in ((1, 58), (3, 50)):  # humaneval#5 and #7 = the 2nd and 4th humaneval prompts
    ids = apply_chat_template(tok, prompts[idx].text)
    out = []
    for t in llm.generate(ids, temp=0.0, reset=True):
        out.append(t)
        if len(out) == pos + 1: break
    # one row: prefix evaluated, then the last token alone
    seq = ids + out[:pos]
    def logits_at_end(chunk):
        llm.reset(); llm.eval(seq[:-chunk]); llm.eval(seq[-chunk:])
        return np.array(llm.scores[llm.n_tokens - 1])
    one, eight = logits_at_end(1), logits_at_end(8)
    top = np.argsort(-one)[:2]
    print(f"humaneval prompt {idx} position {pos}: plain token {out[pos]}; 1-row top-2 {top.tolist()} margin "
          f"{one[top[0]] - one[top[1]]:.4f}; 8-row argmax {int(np.argmax(eight))} (logit diff of the two "
          f"{eight[top[0]] - eight[top[1]]:.4f}); max |Δlogit| 1 vs 8 rows {np.abs(one - eight).max():.4f}")
