"""MuSiQue examples and the prompt CacheBlend's own MuSiQue evaluation uses, in the model's chat template.

The rendered chat text is split at the passages, and every piece is tokenized on its own:

    [lead: system turn + user header + "Passages:\\n"] [passage 1] ... [passage k] [tail: question + assistant opener]

so each passage's token ids are exactly those its chunk KV is computed for, and every
method (full prefill included) sees the very same token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cacheblend_rag.kv.segments import FreshSegment, Segment, StoredSegment
from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.reuse.prompt import STAND_IN_PASSAGE, split_prompt

SYSTEM_INSTRUCTION = (
    "You will be asked a question after reading several passages. Please directly answer the question "
    "based on the given passages. Do NOT repeat the question. The answer should be within 5 words."
)
PASSAGES_HEADER = "Passages:\n"
QUESTION_INSTRUCTION = (
    "Answer the question directly based on the given passages. Do NOT repeat the question. "
    "The answer should be within 5 words.\nQuestion: "
)


@dataclass
class MusiqueExample:
    question: str
    answers: list[str]
    passages: list[tuple[str, str]]  # (title, text)


def load_musique(path: str | Path, n: int | None = None) -> list[MusiqueExample]:
    """Read a MuSiQue-format JSON list of ``{question, answers, ctxs: [{title, text}]}``."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"--data {path}: file not found; pass a MuSiQue-format JSON file (e.g. ../shared/data/musique_dev.json)"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--data {path}: not valid JSON ({exc})") from None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"--data {path}: expected a non-empty JSON list of {{question, answers, ctxs}} objects")
    examples = []
    for i, item in enumerate(raw[: n if n else None]):
        examples.append(_parse_example(item, i, path))
    return examples


def _parse_example(item: Any, index: int, path: Path) -> MusiqueExample:
    where = f"--data {path}: example {index}"
    if not isinstance(item, dict):
        raise ConfigError(f"{where} is a {type(item).__name__}, expected an object with question, answers, ctxs")
    missing = [k for k in ("question", "answers", "ctxs") if k not in item]
    if missing:
        raise ConfigError(
            f"{where} lacks {', '.join(missing)}; MuSiQue format is {{question, answers, ctxs: [{{title, text}}]}}"
        )
    answers = item["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers) or not answers:
        raise ConfigError(f"{where}: 'answers' must be a non-empty list of strings")
    passages = []
    for j, ctx in enumerate(item["ctxs"]):
        if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
            raise ConfigError(f"{where}: ctxs[{j}] must be an object with a 'text' string (and an optional 'title')")
        passages.append((str(ctx.get("title") or ""), ctx["text"]))
    if not passages:
        raise ConfigError(f"{where}: 'ctxs' is empty; every question needs at least one passage")
    return MusiqueExample(question=str(item["question"]), answers=list(answers), passages=passages)


def passage_text(title: str, text: str) -> str:
    """One cached chunk, as CacheBlend's evaluation lays passages out."""
    return f"{title}\n\n{text}\n\n"


@dataclass
class BenchPrompt:
    """One question's prompt as token-id pieces."""

    lead_ids: list[int]  # chat template up to and including "Passages:\n"
    chunk_ids: list[list[int]]  # one list per passage
    tail_ids: list[int]  # question with its instruction, end of turn, assistant opener
    text: str  # the rendered chat text, for reference
    passage_texts: list[str] = field(default_factory=list)
    stand_in_ids: list[int] = field(default_factory=list)  # the stand-in passage (cacheblend_rag.reuse.prompt)

    @property
    def input_ids(self) -> list[int]:
        return [*self.lead_ids, *(t for c in self.chunk_ids for t in c), *self.tail_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.lead_ids) + sum(len(c) for c in self.chunk_ids) + len(self.tail_ids)

    @property
    def prefix_cache_length(self) -> int:
        """Tokens a prefix cache holds for this prompt: everything up to and including the first passage."""
        return len(self.lead_ids) + len(self.chunk_ids[0])

    def conditioning_prefix(self, prefix_conditioned: bool) -> tuple[int, ...]:
        """The prefix chunks are precomputed behind: the lead (the text before every passage) and the
        stand-in passage, or nothing."""
        return (*self.lead_ids, *self.stand_in_ids) if prefix_conditioned else ()

    def stored_segments(self, prefix_ids: Sequence[int] = ()) -> list[Segment]:
        """Segments for ``engine.blend(store=...)``: passages fetched from the chunk store. The lead,
        the same for every question, is stored too, behind nothing: the blend reuses it as an
        exact prefix (prefix caching of the system prompt, as a serving engine would)."""
        return [
            StoredSegment(self.lead_ids),
            *(StoredSegment(c, prefix_ids) for c in self.chunk_ids),
            FreshSegment(self.tail_ids),
        ]


def build_prompt(
    tokenizer: Any,
    example: MusiqueExample,
    *,
    passages: int,
    max_passage_tokens: int | None = None,
) -> BenchPrompt:
    """Render ``example`` with ``tokenizer``'s chat template and split it into token-id pieces."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "the model's tokenizer has no chat template; the MuSiQue benchmark wraps its prompt in one. "
            "Use an instruction-tuned model (the default SmolLM2-135M-Instruct has one)"
        )

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    texts = []
    for title, text in example.passages[:passages]:
        if max_passage_tokens is not None:
            text = tokenizer.decode(tokenize(text)[:max_passage_tokens])
        if (title + text).strip():
            texts.append(passage_text(title, text))
    if not texts:
        raise BlendInputError(f"question {example.question!r} has no non-empty passage")

    question = example.question.strip()
    messages = [
        {"role": "system", "content": SYSTEM_INSTRUCTION},
        {"role": "user", "content": PASSAGES_HEADER + "".join(texts) + QUESTION_INSTRUCTION + question},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    split = split_prompt(rendered, texts)
    pieces = split.pieces
    chunks = [p.text for p in pieces if p.is_chunk]
    # Expected layout: fresh lead, the passages back to back in order, fresh tail.
    if (
        chunks != texts
        or len(pieces) != len(texts) + 2
        or pieces[0].is_chunk
        or pieces[-1].is_chunk
    ):
        raise BlendInputError(
            f"could not find the {len(texts)} passages of question {example.question!r} verbatim and in order "
            "in the rendered chat template (does the template rewrite message content?)"
        )
    lead, tail = tokenize(pieces[0].text), tokenize(pieces[-1].text)
    return BenchPrompt(
        lead_ids=lead,
        chunk_ids=[tokenize(t) for t in texts],
        tail_ids=tail,
        text=rendered,
        passage_texts=texts,
        stand_in_ids=tokenize(STAND_IN_PASSAGE),
    )
