"""Stop strings: the decoded-text check ``Decoding.accept`` makes against transformers' ``StopStringCriteria``
on SmolLM2's tokenizer (prints JSON): where each first says stop on the same answers, what the criteria cost
to build for a new list of stop strings, and each one's time per token.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_stop_strings.py

Why decoding keeps the text check (cacheblend_rag/engine/decode.py, ``Decoding.accept``): it also needs where
the stop string starts in the text, to cut the answer there and to hold back text that could start one,
which the criteria's yes/no does not give; the criteria would be a second check of the same thing, built
anew (vocabulary-wide) for each new list of stop strings a call brings.
"""

from __future__ import annotations

import json
import random
import time

import torch
from transformers import StopStringCriteria

from cacheblend_rag.engine.detokenize import IncrementalText
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.dtype_choice import cpu_model_name

TEXTS = ["The answer is 42.\n\nQuestion: what?", "Observation: the tool said hi", "a .b , c", "日本語のテキスト。終わり",
         "User: hello\nAssistant: hi</s>", "```python\nprint(1)\n```\nDone", "Final Answer: yes", "x  y   z\n\n\n"]
STOPS = ["\n\n", "Question:", "Observation:", " .", "。", "```\n", "Answer", "  ", "</s>", "\nAssistant"]


def main() -> None:
    torch.set_num_threads(1)
    tokenizer = load_model(None).tokenizer
    rng = random.Random(0)
    started = time.perf_counter()
    StopStringCriteria(tokenizer, ["Observation:", "\n\nHuman:"])
    build_s = time.perf_counter() - started
    agree, disagree, text_s, criteria_s, tokens = 0, [], 0.0, 0.0, 0
    for _ in range(300):
        text, stops = rng.choice(TEXTS) + rng.choice(TEXTS), rng.sample(STOPS, 2)
        ids = tokenizer.encode(text, add_special_tokens=False)
        criteria, decoded = StopStringCriteria(tokenizer, stops), IncrementalText(tokenizer)
        by_text = by_criteria = None
        for n in range(1, len(ids) + 1):
            t0 = time.perf_counter()
            hit = any(s in decoded.update(ids[:n]) for s in stops)
            t1 = time.perf_counter()
            stop = bool(criteria(torch.tensor([ids[:n]]), None)[0])
            criteria_s += time.perf_counter() - t1
            text_s += t1 - t0
            tokens += 1
            by_text = n if by_text is None and hit else by_text
            by_criteria = n if by_criteria is None and stop else by_criteria
        if by_text == by_criteria:
            agree += 1
        elif len(disagree) < 5:
            disagree.append({"text": text, "stops": stops, "text_check_at": by_text, "criteria_at": by_criteria})
    print(json.dumps({"cpu": cpu_model_name(), "torch": torch.__version__, "tokenizer vocabulary": len(tokenizer),
                      "answers": 300, "first stop agrees": agree, "disagreements": disagree,
                      "criteria build for a new stop list (s)": round(build_s, 3),
                      "text check per token (us, incl. decoding the text)": round(1e6 * text_s / tokens, 1),
                      "criteria per token (us)": round(1e6 * criteria_s / tokens, 1)}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
