"""Chunk texts and a question shared by the store tests (tests/store is on sys.path under pytest)."""

TEXTS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 2,
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris. " * 2,
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean. " * 2,
]
QUESTION = "Question: What is the capital of France? Answer:"
