"""Answer-quality tables of saved benchmark runs, on the questions every run finished.

    python benchmarks/answer_tables.py results/qwen15_p100.json results/smollm2_p100.json

One table per run (F1 and EM against gold, the F1 difference to full prefill with its paired
bootstrap 95% interval, KL, top-1, recovery, TTFT speedup), each summarised again over the
questions common to all runs, so two models are compared on the same questions.
"""

from __future__ import annotations

import argparse
import json

from cacheblend_rag.bench.summary import restrict_document
from cacheblend_rag.bench.report import answer_table, describe_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON written by `cacheblend-rag bench --out` (partial ones too)")
    args = parser.parse_args(argv)
    documents = []
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            documents.append(json.load(f))
    common = sorted(set.intersection(*({e["index"] for e in d["examples"]} for d in documents)))
    print(f"questions common to every run ({len(common)}): {common}\n")
    for path, document in zip(args.results, documents):
        restricted = restrict_document(document, common)
        print(f"{path}: {describe_run(restricted)}\n")
        print(answer_table(restricted) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
