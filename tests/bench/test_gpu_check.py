"""``make gpu-check`` (benchmarks/gpu_check.py): it says so and exits 0 without CUDA, and every step
works, checked on tiny models on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_zero():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "CUDA is not available here" in done.stdout


@pytest.mark.slow
def test_every_step_runs_on_tiny_models_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| model | dtype | prompt tokens | full prefill |" in done.stdout
    import json

    report = json.loads(out.read_text())
    assert report["invariant_tests"]["passed"] and report["gate"]["passed"] and report["store_round_trip"]["passed"]
    assert [row["model"] for row in report["ttft"]][0] == "tiny Llama (smoke)"
    # A tiny Qwen2 stands in for the quality model: its correctness check and TTFT row run too.
    quality = report["quality_model"]
    assert quality["checked"] and quality["passed"] and quality["store_round_trip"]["passed"]
    assert "tiny Qwen2 (smoke, for qwen2.5-coder-1.5b)" in [row["model"] for row in report["ttft"]]
    assert report["ttft"][-1]["model"].startswith("random Mistral-7B shape")
    assert all(row["full prefill"] > 0 and row["default@0.15 (disk)"] > 0 for row in report["ttft"])
    # The kernel profile runs on the quality model's stand-in.
    assert report["kernel_profile"][0]["model"] == "tiny Qwen2 (smoke, for qwen2.5-coder-1.5b)"
    assert report["kernel_profile"][0]["default@0.15"]["wall_ms_profiled"] > 0


def test_models_selects_what_is_timed_and_refuses_a_name_it_does_not_know(gpu_check, monkeypatch, tmp_path):
    """In process, the steps before the timing stubbed (the test above runs them): only the model asked for
    is timed. (As a subprocess the whole smoke ran again: ~30 s.)"""
    import json

    monkeypatch.setattr(gpu_check, "run_invariant_tests", lambda device, select=None: {
        "summary": "stubbed", "passed": True, "output": ""})
    monkeypatch.setattr(gpu_check, "embedded_engine", lambda device, dtype, smoke: (None, "stubbed"))
    monkeypatch.setattr(gpu_check, "quality_engine", lambda device, dtype, smoke: (None, "stubbed"))
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--smoke", "--models", "qwen-1.5b", "--out", str(out)]) == 0
    timed = [row["model"] for row in json.loads(out.read_text())["ttft"]]
    assert timed == ["random Qwen2.5-1.5B shape (0.00B)"]  # the quality model's random stand-in, alone
    done = subprocess.run([sys.executable, str(SCRIPT), "--models", "gpt-9"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "choose from smollm2, llama-1b, qwen-1.5b, mistral-7b" in done.stderr


# ------------------------------------------------------------------ the quality model, without CUDA
@pytest.fixture
def gpu_check(monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _installed(monkeypatch, module, path):
    """Make the catalog say the quality model is fetched at ``path`` (``None``: not fetched)."""
    from cacheblend_rag.errors import ModelLoadError

    def installed_gguf(model, root):
        assert model.name == module.QUALITY_MODEL
        if path is None:
            raise ModelLoadError(f"model {model.name!r} is not fetched on this machine; fetch it once with make")
        return path

    monkeypatch.setattr(module.catalog, "installed_gguf", installed_gguf)
    # Loading would read real weights: a tiny engine stands in, and the test sees what was asked for.
    asked = []

    def from_pretrained(name, **kwargs):
        from cacheblend_rag.testing import tiny_engine

        asked.append((name, kwargs))
        return tiny_engine("qwen2")

    monkeypatch.setattr(module.CacheBlendEngine, "from_pretrained", staticmethod(from_pretrained))
    return asked


def test_the_quality_model_is_used_when_installed(gpu_check, monkeypatch, tmp_path):
    gguf = tmp_path / "qwen.gguf"
    asked = _installed(monkeypatch, gpu_check, gguf)
    assert gpu_check.installed_quality_model() == (gguf, f"qwen2.5-coder-1.5b is installed ({gguf})")
    engine, line = gpu_check.quality_engine(torch.device("cpu"), torch.bfloat16, smoke=False)
    assert engine is not None and "is installed" in line
    assert asked == [("qwen2.5-coder-1.5b", {"device": torch.device("cpu"), "dtype": torch.bfloat16})]


def test_the_quality_model_is_skipped_with_a_clear_line_when_not_installed(gpu_check, monkeypatch):
    asked = _installed(monkeypatch, gpu_check, None)
    path, why = gpu_check.installed_quality_model()
    assert path is None and "not fetched on this machine" in why
    engine, line = gpu_check.quality_engine(torch.device("cpu"), torch.bfloat16, smoke=False)
    assert engine is None and asked == []  # never loaded, never fetched
    assert line.startswith("the quality model is not installed here, so its correctness check is skipped")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("installed", [True, False])
def test_without_cuda_it_says_what_it_would_do_with_the_quality_model(gpu_check, monkeypatch, tmp_path, capsys,
                                                                      installed):
    asked = _installed(monkeypatch, gpu_check, tmp_path / "qwen.gguf" if installed else None)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "CUDA is not available here" in out and asked == []
    expected = "There it also checks the quality model" if installed else "There it would skip the quality model"
    assert expected in out


ROWS = [{"label": "qwen-1.5b", "shape": [10, 300], "full prefill": 0.030, "CacheBlend@0.15": 0.010,
         "CacheBlend@0.15 (resident)": 0.020, "default@0.15": 0.014}]


def test_issue_58_targets_are_read_from_the_rows_timed_in_the_same_call(script_module):
    with script_module("gpu_check") as module:
        found = {(t["model"], t["shape"], t["method"]): t for t in module.targets(ROWS)}
    assert found[("qwen-1.5b", "10 x 300", "CacheBlend@0.15")]["speedup"] == 3.0
    assert found[("qwen-1.5b", "10 x 300", "CacheBlend@0.15")]["met"] is True
    assert found[("qwen-1.5b", "10 x 300", "CacheBlend@0.15 (resident)")]["met"] is False
    assert found[("qwen-1.5b", "10 x 300", "default@0.15")]["met"] is True
    assert found[("mistral-7b", "8 x 512", "CacheBlend@0.15")]["met"] is None  # not timed in this call
