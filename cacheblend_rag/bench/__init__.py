"""The MuSiQue benchmark harness behind ``cacheblend-rag bench``: prompts, methods, metrics, reports."""

from cacheblend_rag.bench.config import BenchConfig
from cacheblend_rag.bench.harness import run_benchmark
from cacheblend_rag.bench.methods import MethodSpec, parse_methods
from cacheblend_rag.bench.metrics import f1_score, gold_f1, normalize_answer, recovery, token_kl, top1_agreement
from cacheblend_rag.bench.runner import BenchmarkRunner

__all__ = [
    "BenchConfig", "BenchmarkRunner", "MethodSpec", "f1_score", "gold_f1", "normalize_answer", "parse_methods",
    "recovery", "run_benchmark", "token_kl", "top1_agreement",
]
