"""The dtype a model loads in when none is given: bfloat16 on a CPU where the probe measures it clearly
faster, float32 where it does not, an explicit dtype or $CACHEBLEND_DTYPE always first, the probe's
result kept per machine in a JSON file that is rewritten when damaged. The probe and the CPU's flags
are stubbed, so these tests say the same on any machine; one test times the real probe."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, CachedSegment, FreshSegment, ModelLoadError
from cacheblend_rag.cli import build_parser
from cacheblend_rag.models import dtype_choice
from cacheblend_rag.models.dtype_choice import DTYPE_ENV, PROBE_FILE, probe_matmul
from cacheblend_rag.models.loader import cache_root
from cacheblend_rag.testing import save_tiny_model

CPU = torch.device("cpu")


def probe_cache_path():
    return cache_root() / PROBE_FILE


def choose_dtype(dtype, device, width):
    """As the loader chooses: the probe kept in the cache root."""
    return dtype_choice.choose_dtype(dtype, device, width, probe_cache_path())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


class Probe:
    """A stand-in for the matmul probe: float32 and bfloat16 timings as given, and how often it ran."""

    def __init__(self, float32_s: float, bfloat16_s: float) -> None:
        self.times, self.calls, self.widths = (float32_s, bfloat16_s), 0, []

    def __call__(self, width: int) -> tuple[float, float]:
        self.calls += 1
        self.widths.append(width)
        return self.times


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An AMX CPU whose probe the test sets, a cache root of the test's own, no $CACHEBLEND_DTYPE (the root
    conftest sets float32 for the suite)."""
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dtype_choice, "cpu_model_name", lambda: "Test Xeon")
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx512f", "amx_bf16", "avx512_bf16"})

    def set_probe(float32_s: float, bfloat16_s: float) -> Probe:
        probe = Probe(float32_s, bfloat16_s)
        monkeypatch.setattr(dtype_choice, "probe_matmul", probe)
        return probe

    return set_probe


def test_a_cpu_with_fast_bfloat16_loads_in_bfloat16_and_says_why(machine, folder):
    probe = machine(4e-3, 1e-3)
    engine = CacheBlendEngine.from_pretrained(str(folder), device="cpu", min_blend_tokens=0)
    assert engine.dtype == torch.bfloat16 and next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.dtype_reason == "auto: bfloat16, 4.0x faster matmul than float32 on Test Xeon (amx_bf16, avx512_bf16)"
    assert probe.widths == [64]  # the tiny model's hidden size, read from its config before the weights load
    # The stats of a blend carry the dtype and the reason.
    chunk = engine.prefill_chunk(engine.tokenize("Paris is the capital of France."))
    stats = engine.blend([CachedSegment(chunk), FreshSegment(engine.tokenize("Question: capital?"))]).stats
    assert (stats.dtype, stats.dtype_reason) == ("bfloat16", engine.dtype_reason)
    assert stats.to_dict()["dtype_reason"] == engine.dtype_reason
    # Measured once per machine: the next load reads the kept result.
    again = CacheBlendEngine.from_pretrained(str(folder), device="cpu")
    assert again.dtype == torch.bfloat16 and probe.calls == 1
    entry = json.loads(probe_cache_path().read_text())["entries"][dtype_choice.probe_key("Test Xeon", 64)]
    assert entry["speedup"] == 4.0


def test_a_cpu_where_bfloat16_is_not_clearly_faster_loads_in_float32(machine, folder):
    machine(1.1e-3, 1e-3)
    engine = CacheBlendEngine.from_pretrained(str(folder), device="cpu")
    assert engine.dtype == torch.float32
    assert engine.dtype_reason == ("auto: float32, bfloat16 matmul only 1.10x as fast on Test Xeon (amx_bf16, "
                                   "avx512_bf16) (under 1.3x)")


def test_a_cpu_without_bfloat16_units_is_not_even_probed(machine, monkeypatch):
    probe = machine(4e-3, 1e-3)
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx2", "avx512f"})
    choice = choose_dtype(None, CPU, 576)
    assert choice.dtype == torch.float32 and probe.calls == 0
    assert choice.reason == "auto: float32, no fast bfloat16 path on Test Xeon (no amx_bf16/avx512_bf16)"
    # Where the flags cannot be read (not Linux), the probe decides alone.
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: None)
    assert choose_dtype("auto", CPU, 576).dtype == torch.bfloat16 and probe.calls == 1


def test_an_explicit_dtype_always_wins_then_the_environment(machine, folder, monkeypatch):
    fast = machine(4e-3, 1e-3)
    engine = CacheBlendEngine.from_pretrained(str(folder), device="cpu", dtype="float32")
    assert (engine.dtype, engine.dtype_reason) == (torch.float32, "explicit: float32")
    assert fast.calls == 0
    machine(1e-3, 4e-3)  # bfloat16 slow: asked for all the same
    assert choose_dtype(torch.bfloat16, CPU, 64).reason == "explicit: bfloat16"
    monkeypatch.setenv(DTYPE_ENV, "float32")
    machine(4e-3, 1e-3)
    assert choose_dtype(None, CPU, 64) == dtype_choice.DtypeChoice(torch.float32, f"{DTYPE_ENV}=float32")
    assert choose_dtype("bf16", CPU, 64).dtype == torch.bfloat16  # the argument before the environment
    assert choose_dtype("auto", CPU, 64).dtype == torch.bfloat16  # "auto" asked for is the auto choice
    monkeypatch.setenv(DTYPE_ENV, "float8")
    with pytest.raises(ModelLoadError, match=r"\$CACHEBLEND_DTYPE='float8' is not supported; choose 'auto' or"):
        choose_dtype(None, CPU, 64)
    with pytest.raises(ModelLoadError, match="dtype='half' is not supported"):
        CacheBlendEngine.from_pretrained(str(folder), dtype="half")


def test_a_gpu_keeps_its_default(monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert choose_dtype(None, torch.device("cuda"), 64).dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose_dtype(None, torch.device("cuda"), 64) == dtype_choice.DtypeChoice(
        torch.float16, "auto: float16, this GPU has no bfloat16")


@pytest.mark.parametrize("content", ["{not json", '{"format": "something else"}', "\x80\x04\x95 a pickle"])
def test_a_damaged_probe_file_is_ignored_and_rewritten(machine, content, caplog):
    probe = machine(4e-3, 1e-3)
    path = probe_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="latin-1")
    with caplog.at_level(logging.WARNING):
        assert choose_dtype(None, CPU, 128).dtype == torch.bfloat16
    assert "ignoring the dtype probe file" in caplog.text and probe.calls == 1
    document = json.loads(path.read_text())
    assert document["format"] == dtype_choice.PROBE_FORMAT and len(document["entries"]) == 1
    choose_dtype(None, CPU, 128)
    assert probe.calls == 1  # read back from the rewritten file


def test_the_probe_times_both_dtypes():
    float32_s, bfloat16_s = probe_matmul(32, rows=16, repeats=1)
    assert 0 < float32_s < 1 and 0 < bfloat16_s < 1


def test_model_info_says_the_dtype_and_why(machine, folder, capsys):
    machine(4e-3, 1e-3)
    args = build_parser().parse_args(["model", "info", str(folder), "--device", "cpu"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "dtype: bfloat16 (auto: bfloat16, 4.0x faster matmul than float32 on Test Xeon" in printed
    assert "weights: content:" in printed and "blends: yes" in printed
    args = build_parser().parse_args(["model", "info", str(folder), "--dtype", "float32"])
    assert args.func(args) == 0 and "dtype: float32 (explicit: float32)" in capsys.readouterr().out
