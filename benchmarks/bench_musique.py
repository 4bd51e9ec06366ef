"""MuSiQue benchmark: TTFT, throughput and quality of every method against full prefill.

Same options as ``cacheblend-rag bench``; for example, a results table like those of docs/performance.md:

    python benchmarks/bench_musique.py --data ../shared/data/musique_dev.json \
        --out results/musique.json --plot results/musique.png
"""

import sys

from cacheblend_rag.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
