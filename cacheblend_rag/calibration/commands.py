"""``cacheblend-rag calibrate``: measure candidate blend settings on a few prompts and save the
cheapest that meets the fidelity target (KL, and answers when asked), for this model on this device
type (:mod:`cacheblend_rag.calibration.measure`). On a GPU, run it there with ``--cost ttft``: the
engine prefers a setting measured on its own device type."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cacheblend_rag.calibration.measure import (
    DEFAULT_CANDIDATES,
    CalibrationTarget,
    calibrate,
    default_state_path,
    parse_candidates,
)
from cacheblend_rag.bench.runner import answerable
from cacheblend_rag.bench.prompt import BenchPrompt, MusiqueExample, build_prompt, load_musique
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.calibration.lookup import CALIBRATION_DIR_ENV
from cacheblend_rag.errors import CacheBlendError, ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".rst")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="choose, by measurement, the cheapest blend setting that keeps this model close to full prefill",
        description=__doc__ + "\n\nPrompts are built as the benchmark builds them (chat template, the lead as an "
        "exact prefix). The result is saved per model fingerprint; the engine and both integrations use it "
        "whenever they are given no blend setting.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_command)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_argument_group("prompts (one of --data, or --corpus with --questions)")
    data.add_argument("--data", default=None,
                      help="MuSiQue-format JSON (a list of {question, answers, ctxs: [{title, text}]}), or a JSONL of "
                           "{question, passages: [text or {title, text}]}, one prompt a line")
    data.add_argument("--corpus", default=None,
                      help=f"a folder of text files ({', '.join(TEXT_SUFFIXES)}), your warmed corpus: each question "
                           "gets --passages of them, taken in turn")
    data.add_argument("--questions", default=None,
                      help="with --corpus: sample questions, one a line (or a JSON list of strings)")
    data.add_argument("--n", type=int, default=8,
                      help="prompts to calibrate on (the first N; with --answerable, the first N holding their answer)")
    data.add_argument("--passages", type=int, default=10, help="passages per prompt, each one cached chunk")
    data.add_argument("--max-passage-tokens", type=int, default=None, help="truncate each passage to this many tokens")
    data.add_argument("--answerable", action="store_true",
                      help="MuSiQue data: keep only questions whose gold answer is in the passages after truncation")

    target = parser.add_argument_group("target and candidates")
    target.add_argument("--target-recovery", type=float, default=0.8,
                        help="least share of full reuse's KL to full prefill a setting must recover")
    target.add_argument("--allow-worse", type=int, default=0, help="prompts allowed to be worse than full reuse")
    target.add_argument("--min-top1", type=float, default=None,
                        help="a target on answers: the least mean top-1 agreement with full prefill along its answer, "
                             "teacher-forced (0.9: nine answer tokens in ten ranked first as full prefill ranks them) "
                             "(default: none)")
    target.add_argument("--min-identical-answers", type=float, default=None,
                        help="a target on answers: the least share of prompts whose greedy answer (its first "
                             "--teacher-tokens tokens) is full prefill's, e.g. 0.6 (default: none)")
    target.add_argument("--max-cost", type=float, default=None,
                        help="the most a setting may cost, full prefill = 1 (with --cost ttft, 0.29 keeps a 3.5x "
                             "speedup; in work units the engine reaches ~0.7-0.9 of the bound on a CPU, so ~0.25); a "
                             "setting above it is not chosen even when the target is out of reach, unless every "
                             "candidate is (then the cheapest, said plainly) (default: no ceiling: quality first, "
                             "e.g. Qwen2.5-Coder-1.5B at 300-token passages gets query_profiled+prefix@0.5, ~1.9x)")
    target.add_argument("--cost", choices=("work", "ttft"), default="work",
                        help="what 'cheapest' means: layer-units computed (deterministic) or measured TTFT (use it on "
                             "a GPU, run on the GPU: there a higher ratio costs far less than the work it adds)")
    target.add_argument("--candidates", default=None,
                        help="comma-separated settings as bench --methods writes them "
                             "(NAME[+prefix][+keyshift|+probeshift]@RATIO), e.g. "
                             "'kv_deviation@0.15,query_profiled+prefix@0.15'; default: " + ",".join(DEFAULT_CANDIDATES))
    target.add_argument("--teacher-tokens", type=int, default=16,
                        help="tokens of full prefill's answer the KL is measured along")

    model = parser.add_argument_group("model and output")
    model.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M-Instruct)")
    model.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    model.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: per device)")
    model.add_argument("--out", default=None,
                       help=f"calibration folder to save into (default: ${CALIBRATION_DIR_ENV}, else "
                            "~/.cache/cacheblend-rag/calibration); the engine looks there")
    model.add_argument("--resume", action="store_true",
                       help="keep the measurements a stopped run saved (<out>/<fingerprint>.state.json) and make only "
                            "the missing ones")
    model.add_argument("--no-progress", action="store_true", help="hide the progress bar")


# --------------------------------------------------------------------------- prompts
def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise ConfigError(f"--{name.replace('_', '-')}={value} must be at least 1")


def load_examples(args: argparse.Namespace) -> list[MusiqueExample]:
    """The questions and passages ``args`` names, as :class:`MusiqueExample` (answers may be empty)."""
    if (args.data is None) == (args.corpus is None):
        raise ConfigError("pass --data (MuSiQue JSON or a JSONL of {question, passages}) or --corpus with --questions")
    # With --answerable, --n counts the prompts kept (build_prompts), so every question is read here.
    n = None if getattr(args, "answerable", False) else args.n
    if args.corpus is not None:
        return _corpus_examples(Path(args.corpus), args.questions, n, args.passages)
    if str(args.data).endswith(".jsonl"):
        return _jsonl_examples(Path(args.data), n)
    return load_musique(args.data, n)


def _jsonl_examples(path: Path, n: int | None) -> list[MusiqueExample]:
    if not path.exists():
        raise ConfigError(f"--data {path}: file not found")
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--data {path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or \
                not isinstance(item.get("passages"), list) or not item["passages"]:
            raise ConfigError(f"{where}: expected {{\"question\": text, \"passages\": [text or {{title, text}}, ...]}}")
        passages = []
        for p in item["passages"]:
            if isinstance(p, str):
                passages.append(("", p))
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                passages.append((str(p.get("title") or ""), p["text"]))
            else:
                raise ConfigError(f"{where}: a passage must be text or {{\"title\", \"text\"}}, got {p!r:.60}")
        answers = item.get("answers") or []
        examples.append(MusiqueExample(item["question"], [answers] if isinstance(answers, str) else list(answers),
                                       passages))
        if n and len(examples) >= n:
            break
    if not examples:
        raise ConfigError(f"--data {path} holds no prompt")
    return examples


def _corpus_examples(folder: Path, questions: str | None, n: int | None, passages: int) -> list[MusiqueExample]:
    if not folder.is_dir():
        raise ConfigError(f"--corpus {folder}: not a folder")
    if questions is None:
        raise ConfigError("--corpus needs --questions FILE: sample questions, one a line")
    files = sorted(p for p in folder.iterdir() if p.suffix in TEXT_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"--corpus {folder} holds no {', '.join(TEXT_SUFFIXES)} file")
    qpath = Path(questions)
    if not qpath.exists():
        raise ConfigError(f"--questions {qpath}: file not found")
    text = qpath.read_text(encoding="utf-8")
    try:
        loaded = json.loads(text)
        asked = [q if isinstance(q, str) else q.get("question") for q in loaded] if isinstance(loaded, list) else None
    except json.JSONDecodeError:
        asked = [line.strip() for line in text.splitlines() if line.strip()]
    if not asked or not all(isinstance(q, str) and q.strip() for q in asked):
        raise ConfigError(f"--questions {qpath}: expected questions one a line, or a JSON list of strings")
    texts = [(p.stem, p.read_text(encoding="utf-8")) for p in files]
    # Calibration measures how blending changes the model's answer, not retrieval: any passages of
    # the corpus will do, so each question takes the next ones in turn.
    k = min(passages, len(texts))
    return [MusiqueExample(q, [], [texts[(i * k + j) % len(texts)] for j in range(k)])
            for i, q in enumerate(asked[: n or None])]


def build_prompts(engine: CacheBlendEngine, examples: list[MusiqueExample],
                  args: argparse.Namespace) -> list[BenchPrompt]:
    prompts = [build_prompt(engine.tokenizer, ex, passages=args.passages, max_passage_tokens=args.max_passage_tokens)
               for ex in examples]
    chosen = list(range(len(examples)))
    if args.answerable:
        if not any(ex.answers for ex in examples):
            raise ConfigError("--answerable needs gold answers (MuSiQue data); these prompts have none")
        kept = answerable(examples, prompts)
        print(f"--answerable: {len(kept)} of {len(examples)} questions hold their gold answer in the prompt; "
              f"calibrating on the first {min(len(kept), args.n)}", file=sys.stderr)
        if not kept:
            raise ConfigError("--answerable kept no question; raise --max-passage-tokens or --passages")
        chosen = kept[:args.n]
    for i in chosen:
        if prompts[i].num_tokens + args.teacher_tokens > engine.context_window:
            raise ConfigError(f"question {examples[i].question!r}: the prompt has {prompts[i].num_tokens} tokens, "
                              f"beyond the model's context of {engine.context_window} with the answer; lower "
                              "--passages or set --max-passage-tokens")
    return [prompts[i] for i in chosen]


# --------------------------------------------------------------------------- the command
def run_calibration(args: argparse.Namespace, engine: CacheBlendEngine | None = None) -> int:
    """The command's work; ``engine``: a ready one (tests), else ``--model`` is loaded."""
    for name in ("n", "passages", "max_passage_tokens", "teacher_tokens"):
        _positive(name, getattr(args, name))
    target = CalibrationTarget(args.target_recovery, args.allow_worse, args.max_cost, min_top1=args.min_top1,
                               min_identical_answers=args.min_identical_answers)
    candidates = parse_candidates(args.candidates)
    examples = load_examples(args)
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    prompts = build_prompts(engine, examples, args)
    device = engine.device.type
    state_path = default_state_path(engine.fingerprint, args.out, device)
    data = {"data": args.data, "corpus": args.corpus, "questions": args.questions, "passages": args.passages,
            "max_passage_tokens": args.max_passage_tokens, "answerable": args.answerable}
    print(f"calibrating {engine.model_name} ({engine.fingerprint[:12]}) on {device} on {len(prompts)} prompts, "
          f"{len(candidates)} candidate settings; measurements go to {state_path}", file=sys.stderr)
    try:
        result = calibrate(engine, prompts, candidates, target, cost=args.cost, teacher_tokens=args.teacher_tokens,
                           progress=not args.no_progress, state_path=state_path, resume=args.resume, data=data)
    except KeyboardInterrupt:
        print(f"\nstopped: the measurements made so far are kept in {state_path}; run the same command with "
              "--resume to go on", file=sys.stderr)
        return 130
    path = result.save(args.out)
    print(result.target_line())
    print()
    print(result.table())
    print()
    print(result.message)
    print(f"\nsaved to {path}: the engine, CacheBlendLLM and ChatCacheBlend on this model on {device} now use "
          f"{result.chosen.name} when given no blend setting (their stats say config_source: calibrated); on another "
          "device type a setting measured there comes first")
    return 0


def run_command(args: argparse.Namespace) -> int:
    try:
        return run_calibration(args)
    except CacheBlendError as exc:  # bad options or data: say what is wrong, no traceback
        print(f"cacheblend-rag calibrate: error: {exc}", file=sys.stderr)
        return 2
