"""The arguments :class:`~cacheblend_rag.serving.settings.CacheBlendSettings` takes, checked and read
before pydantic sees them: which names are fields (an unknown one is an error naming the closest known
one), the BlendConfig and sampling fields checked as the user wrote them, and the Hugging Face
integrations' spellings (``model_id``, ``torch_dtype``, ``device_map``...) turned into these fields, and
``model.generate``'s keyword arguments (``generate_kwargs``) into a :class:`GenerationConfig`'s, or refused
with what to pass instead.
"""

from __future__ import annotations

import difflib
import functools
import logging
from dataclasses import fields
from typing import Any, Optional

import torch

from cacheblend_rag.config import BlendConfig, GenerationConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import resolve_device

# Every BlendConfig field is exposed, under its own name; calls may override them too.
BLEND_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(BlendConfig))

# The sampling fields both expose; the answer's length is each framework's own (max_new_tokens, max_tokens).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "min_new_tokens")


# Other libraries' names for a setting, and ours, in the order tried: the closest spelling would mislead
# (max_new_tokens is closest to min_new_tokens). Each integration has one of the length names.
_NAMES_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "max_new_tokens": ("max_tokens",),
    "max_tokens": ("max_new_tokens",),
    "max_output_tokens": ("max_tokens", "max_new_tokens"),
    "num_predict": ("max_tokens", "max_new_tokens"),
    "stop_sequences": ("stop",),
    "stop_words": ("stop",),
}

# Names refused with a reason rather than a spelling.
_EXPLAINED = {
    "trust_remote_code": "the embedded, catalog and GGUF models run no remote code; for a hub model whose "
    "architecture needs it pass model_kwargs={'trust_remote_code': True} (a blend also needs an architecture "
    "cacheblend_rag supports, else fallback_to_full_prefill=True serves it with full prefill)",
}


def unknown_names_error(owner: str, unknown: list[str], allowed: set[str], what: str = "argument") -> ValueError:
    """``owner got unknown argument(s) 'x' (did you mean 'y'?)``: another library's name for a setting
    gets ours, a name with no equivalent the reason, any other the closest known spelling."""
    hints = []
    for name in unknown:
        if name in _EXPLAINED:
            hints.append(f"{name!r} ({_EXPLAINED[name]})")
            continue
        ours = [n for n in _NAMES_ELSEWHERE.get(name, ()) if n in allowed][:1]
        close = ours or difflib.get_close_matches(name, sorted(allowed), 1)
        hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return ValueError(f"{owner} got unknown {what}(s) {', '.join(hints)}")


def checked_as_given(values: dict[str, Any]) -> None:
    """Check the BlendConfig and sampling fields as the user wrote them, before pydantic coerces them
    (``recompute_ratio="0.15"`` would become 0.15): one validation, BlendConfig's and
    GenerationConfig's, whatever the entry point. Raises their ConfigError (a ValueError)."""
    blend = {name: values[name] for name in BLEND_FIELDS if name in values}
    if blend:
        BlendConfig(**blend)
    sampling = {name: values[name] for name in SAMPLING_FIELDS if values.get(name) is not None}
    if sampling:
        # The answer's length is checked against min_new_tokens per call, where both are known.
        GenerationConfig(max_new_tokens=max(1, int(sampling.get("min_new_tokens") or 0)), **sampling)


def call_answer_length(owner: str, call: dict[str, Any], default: int, names: tuple[str, ...]) -> int:
    """The answer's length one call asks for under any of ``names`` (``max_tokens``, ``max_new_tokens``), else
    ``default``. A length given is checked as given: ``0`` is refused, never read as "unset" (``x or default``
    did that, and LlamaIndex answered at its default length), and two names that disagree are refused too."""
    given = [(name, call[name]) for name in names if call.get(name) is not None]
    for name, value in given:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
            raise ConfigError(f"{owner} got {name}={value!r}: the answer's length must be an integer in "
                              "[1, 1000000] tokens; leave it out for the default")
    if len({value for _, value in given}) > 1:
        raise ConfigError(f"{owner} got {' and '.join(f'{n}={v!r}' for n, v in given)} in one call: they "
                          "disagree; pass the answer's length once")
    return given[0][1] if given else default


def hugging_face_spellings(owner: str, values: dict[str, Any], max_tokens_field: str,
                           logger: logging.Logger) -> dict[str, Any]:
    """``HuggingFaceLLM``/``ChatHuggingFace`` arguments as this package's fields: ``model_name`` and
    ``model_id`` are ``model``, ``torch_dtype`` is ``dtype``, a one-device ``device_map`` is ``device``.
    ``generate_kwargs`` (``pipeline_kwargs`` merged in) is kept, and those of its keys that have a field
    of their own set it (``max_new_tokens`` the length field, ``stop_strings`` ``stop``, ``do_sample=False``
    ``temperature=0``; a field also given must agree). What cannot be honoured is an error saying what to
    use. The device ``device_map="auto"`` maps to is said in ``logger`` (the caller's)."""
    for alias in ("model_name", "model_id"):
        if alias in values:
            name = values.pop(alias)
            if values.get("model") not in (None, name):
                raise ValueError(f"{owner} got model={values['model']!r} and {alias}={name!r}; pass only model=")
            values["model"] = name
    if "torch_dtype" in values:
        dtype = values.pop("torch_dtype")
        values.setdefault("dtype", str(dtype).removeprefix("torch.") if dtype is not None else None)
    if "device_map" in values:
        values.setdefault("device", _one_device(owner, values.pop("device_map"), logger))
    given = {**_kwargs_dict(owner, "pipeline_kwargs", values.pop("pipeline_kwargs", None)),
             **_kwargs_dict(owner, "generate_kwargs", values.pop("generate_kwargs", None))}
    if given:
        fields_of = {"max_new_tokens": max_tokens_field, "stop": "stop", **{name: name for name in SAMPLING_FIELDS}}
        for name, value in generation_options(owner, "generate_kwargs", given).items():
            if name == "temperature" and given.get("do_sample") is False:
                continue  # greedy whatever the temperature, as model.generate
            if name == "do_sample" and value is False:
                name, value = "temperature", 0.0  # greedy, as the field says it
            field = fields_of.get(name)
            if field is None:
                continue  # no field of its own: applied from generate_kwargs at each call
            if name == "stop":
                value = list(value)
            if values.get(field) is not None and values[field] != value:
                key = "do_sample=False" if name == "temperature" and "do_sample" in given else _given_key(name, given)
                raise ValueError(f"{owner} got {field}={values[field]!r} and generate_kwargs {key}: they disagree; "
                                 f"pass the setting once")
            values[field] = value
        values["generate_kwargs"] = given
    return values


def _kwargs_dict(owner: str, option: str, given: Any) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
        raise ValueError(f"{owner} got {option}={given!r}: pass a dict of model.generate's keyword arguments, "
                         "e.g. {'max_new_tokens': 64, 'do_sample': True, 'temperature': 0.7}")
    return dict(given)


def _given_key(name: str, given: dict[str, Any]) -> str:
    key = next((k for k, ours in _GENERATE_MAPPED.items() if ours == name and k in given), name)
    return f"{key}={given[key]!r}"


# model.generate's keyword arguments a blend's decoding applies, and the GenerationConfig field each sets.
_GENERATE_MAPPED = {
    "max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "temperature": "temperature",
    "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "do_sample": "do_sample", "seed": "seed", "no_repeat_ngram_size": "no_repeat_ngram_size",
    "eos_token_id": "eos_token_id", "stop_strings": "stop",
}
# Accepted where they ask for what decoding does anyway (one sequence, the text without the prompt).
_GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "num_beams": (1,), "num_return_sequences": (1,), "use_cache": (True,), "return_full_text": (False,),
    "pad_token_id": (), "bos_token_id": (), "skip_special_tokens": (True,),
}
_BEAMS = ("beam search keeps several candidate sequences and picks one at the end; a blend decodes one sequence and "
          "streams it token by token; sample instead (do_sample=True, temperature, top_p) or stay greedy")
# Why the others cannot apply, and what to use instead.
_GENERATE_REFUSED = {
    "num_beams": _BEAMS, "num_beam_groups": _BEAMS, "diversity_penalty": _BEAMS, "length_penalty": _BEAMS,
    "early_stopping": _BEAMS, "constraints": _BEAMS, "force_words_ids": _BEAMS,
    "num_return_sequences": "a call answers with one sequence; call again with another seed, or use batch() for "
    "several prompts",
    "assistant_model": "assisted (speculative) decoding drafts tokens with a second model; decoding from a blended "
    "cache runs the one model; leave it out",
    "prompt_lookup_num_tokens": "prompt-lookup decoding drafts tokens from the prompt; decoding from a blended "
    "cache takes one token a step; leave it out",
    "penalty_alpha": "contrastive search rescores candidates with their hidden states, which a blend's decoding "
    "does not keep; use sampling (do_sample=True, top_k, top_p) or greedy",
    "max_length": "it counts the prompt's tokens too; pass max_new_tokens, the answer's tokens",
    "min_length": "it counts the prompt's tokens too; pass min_new_tokens, the answer's tokens",
    "use_cache": "decoding reads the blended KV cache, it cannot run without one; leave use_cache out",
    "return_full_text": "the answer comes back without the prompt; leave it out (or False)",
    "streamer": "stream with the framework's own streaming (stream(), stream_complete(), astream()...)",
    "stopping_criteria": "pass stop strings (stop, or stop_strings here), max_new_tokens or eos_token_id",
    "logits_processor": "decoding applies transformers' processors for temperature, top_k, top_p, min_p, "
    "repetition_penalty, no_repeat_ngram_size and min_new_tokens from their keys; pass those",
    "return_dict_in_generate": "the answer comes back as text (and its token ids in the stats), not scores",
    "output_scores": "the answer comes back as text (and its token ids in the stats), not scores",
    "output_logits": "the answer comes back as text (and its token ids in the stats), not logits",
    "skip_special_tokens": "the answer's text never holds special tokens; leave it out",
}


def generation_options(owner: str, option: str, given: dict[str, Any]) -> dict[str, Any]:
    """``model.generate`` keyword arguments (``generate_kwargs``) as :class:`GenerationConfig` fields
    (``stop_strings`` is ``stop``). Those that ask for what decoding does anyway (``num_beams=1``,
    ``pad_token_id``...) are dropped; one that cannot apply to one streamed sequence (``num_beams=4``,
    ``assistant_model``...) is an error naming it, why and what to use; an unknown one gets the closest
    known spelling."""
    options: dict[str, Any] = {}
    for key, value in given.items():
        if key in _GENERATE_MAPPED:
            if key == "stop_strings":
                value = (value,) if isinstance(value, str) else tuple(value or ())
            options[_GENERATE_MAPPED[key]] = value
        elif key in _GENERATE_NEUTRAL and (not _GENERATE_NEUTRAL[key] or value in _GENERATE_NEUTRAL[key]):
            continue
        elif key in _GENERATE_REFUSED:
            raise ValueError(f"{owner} cannot honour {option} {key}={value!r}: {_GENERATE_REFUSED[key]}")
        elif key in _transformers_generation_keys():
            raise ValueError(f"{owner} cannot honour {option} {key}={value!r}: a blend's decoding does not apply "
                             f"this transformers generation option; it applies {sorted(_GENERATE_MAPPED)}")
        else:
            known = sorted({*_GENERATE_MAPPED, *_GENERATE_NEUTRAL})
            raise unknown_names_error(owner, [key], set(known), f"{option} key")
    if options:  # GenerationConfig's own checks, before the model is loaded or the call starts
        GenerationConfig(**{"max_new_tokens": 1_000_000, **options})
    return options


@functools.lru_cache(maxsize=1)
def _transformers_generation_keys() -> frozenset[str]:
    from transformers import GenerationConfig as TransformersGenerationConfig

    return frozenset(k for k in vars(TransformersGenerationConfig()) if not k.startswith("_"))


def with_generate_kwargs(owner: str, values: dict[str, Any], object_kwargs: dict[str, Any],
                         call: dict[str, Any]) -> dict[str, Any]:
    """A call's GenerationConfig ``values`` (the object's fields and the call's options) with the object's
    ``generate_kwargs`` that have no field of their own, then the call's ``generate_kwargs`` (or
    ``pipeline_kwargs``) on top: its stop strings join the call's stop, any other key wins over the
    object's, and one that the call also passes as an option must agree with it."""
    values = dict(values)
    own = generation_options(owner, "generate_kwargs", object_kwargs) if object_kwargs else {}
    for name, value in own.items():
        if name == "do_sample" and (value is False or call.get("temperature") is not None):
            continue  # False is the field temperature=0; a call's own temperature decides sampling afresh
        if name not in values:
            values[name] = value
    given = {**_kwargs_dict(owner, "pipeline_kwargs", call.get("pipeline_kwargs")),
             **_kwargs_dict(owner, "generate_kwargs", call.get("generate_kwargs"))}
    if not given:
        return values
    options = generation_options(owner, "generate_kwargs", given)
    lengths = [(k, call[k]) for k in ("max_new_tokens", "max_tokens") if call.get(k) is not None]
    if "do_sample" in options or "temperature" in options:
        values.pop("do_sample", None)  # the call decides sampling afresh
    for name, value in options.items():
        passed = lengths if name == "max_new_tokens" else [(name, call[name])] if call.get(name) is not None else []
        clash = next(((key, p) for key, p in passed if p != value), None) if name != "stop" else None
        if clash is not None:
            raise ValueError(f"{owner} got {clash[0]}={clash[1]!r} and generate_kwargs {_given_key(name, given)} in "
                             "one call: they disagree; pass the setting once")
        if name == "stop":
            value = (*values.get("stop", ()), *(s for s in value if s not in values.get("stop", ())))
        values[name] = value
    return values


def _one_device(owner: str, device_map: Any, logger: logging.Logger) -> Optional[str]:
    """The one device a ``device_map`` names (``"auto"``: the best one here, said in the log)."""
    if device_map is None:
        return None
    if device_map == "auto":
        return _auto_device(owner, logger)
    if isinstance(device_map, dict) and len(set(device_map.values())) == 1:
        device_map = next(iter(device_map.values()))
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return f"cuda:{device_map}"
    if isinstance(device_map, str) and device_map not in ("balanced", "balanced_low_0", "sequential"):
        return device_map
    raise ValueError(f"{owner} got device_map={device_map!r}: a blend runs the whole model on one device; pass "
                     "device='cuda:0' (or 'cpu'), or device_map='auto' for the best one here")


def _auto_device(owner: str, logger: logging.Logger) -> str:
    """``device_map="auto"`` as the one device it maps to here; with several GPUs Hugging Face would split the
    model over them, and a blend cannot, so that case is a warning rather than a note."""
    device = str(resolve_device(None))
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 1
    if gpus > 1:
        logger.warning("%s: device_map='auto' runs the whole model on %s (a blend needs the model on one device; "
                       "this machine has %d GPUs); pass device='cuda:N' to choose another", owner, device, gpus)
    else:
        logger.info("%s: device_map='auto' maps to device=%r, the one device here", owner, device)
    return device


__all__ = ["BLEND_FIELDS", "SAMPLING_FIELDS", "call_answer_length", "checked_as_given", "generation_options", "hugging_face_spellings",
           "unknown_names_error", "with_generate_kwargs"]
