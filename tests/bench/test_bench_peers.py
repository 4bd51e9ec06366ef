"""benchmarks/bench_peers.py on a tiny engine, a stub peer and two tiny questions: the report's shape, and
peers that cannot run reported with their reason. Never needs kvboost or llama-cpp-python."""

from __future__ import annotations

import json

import pytest
import torch

from bench_support import peers as peers_module
from bench_support.peers import Answer, Peer, Timed
from cacheblend_rag.testing import tiny_engine


class StubPeer(Peer):
    """Full prefill through the engine's model, claiming the lead as reused; its answer is one token."""

    name = "stub"
    setup = "a stub for the tests"

    def prepare(self, prompt) -> None:
        self.calls = 0  # per prompt: its warm-up, then one call per repeat

    @torch.inference_mode()
    def _logits(self, prompt) -> torch.Tensor:
        return self.ctx.engine.model(input_ids=torch.tensor([prompt.input_ids]), logits_to_keep=1).logits[0, -1]

    def first_token(self, prompt) -> Timed:
        self.calls += 1
        self._logits(prompt)
        return Timed(0.001 * self.calls, len(prompt.lead_ids))

    def answer(self, prompt) -> Answer:
        return Answer("not the reference", self._logits(prompt), len(prompt.lead_ids))


class MissingPeer(StubPeer):
    name, requires, install = "stub-missing", "no_such_module_for_bench_peers", "pip install nothing"


class BrokenPeer(StubPeer):
    name = "stub-broken"

    def prepare(self, prompt) -> None:
        raise RuntimeError("the stub breaks")


@pytest.fixture
def bench(script_module, monkeypatch):
    for cls in (StubPeer, MissingPeer, BrokenPeer):
        monkeypatch.setitem(peers_module.PEERS, cls.name, cls)
    with script_module("bench_peers") as module:
        yield module


def test_report_per_prompt_and_per_peer(bench, musique_file, tmp_path):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    names = ["stub", "stub-missing", "stub-broken", "hf-fp32", "hf-bf16", "hf-prefix-fp32", "cbr-cacheblend@0.15",
             "cbr-full-reuse", "llama-cpp"]
    argv = ["--data", str(musique_file), "--n", "2", "--passages", "3", "--max-passage-tokens", "24",
            "--max-new-tokens", "4", "--repeats", "2", "--peers", ",".join(names), "--out", str(out), "--plot", str(png)]
    assert bench.main(argv, engine=tiny_engine()) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    assert report["questions"] == 2 and report["repeats"] == 2 and report["interleaved"]
    assert report["machine"]["cpu"] and set(report["versions"]) >= {"torch", "transformers", "kvboost", "llama-cpp-python"}
    peers = report["peers"]
    assert list(peers) == names
    assert peers["stub-missing"]["status"] == "skipped"
    assert "no_such_module_for_bench_peers" in peers["stub-missing"]["reason"]
    assert "pip install nothing" in peers["stub-missing"]["reason"]
    assert peers["stub-broken"]["status"] == "failed" and "the stub breaks" in peers["stub-broken"]["reason"]
    assert peers["llama-cpp"]["status"] == "skipped"  # not installed, or no GGUF for an injected engine
    ran = [n for n in names if peers[n]["status"] == "ok"]
    assert ran == ["stub", "hf-fp32", "hf-bf16", "hf-prefix-fp32", "cbr-cacheblend@0.15", "cbr-full-reuse"]
    for row in report["prompts"]:
        assert list(row["peers"]) == ran and row["prompt_tokens"] > 0
        for name in ran:
            entry = row["peers"][name]
            assert len(entry["runs_s"]) == 2 and entry["ttft_s"] > 0
            assert 0 <= entry["reuse_share"] <= 1
            assert entry["reused_tokens"] == round(entry["reuse_share"] * row["prompt_tokens"])
            assert entry["first_token_kl"] >= 0 and isinstance(entry["answer_match"], bool)
        stub, fp32 = row["peers"]["stub"], row["peers"]["hf-fp32"]
        assert stub["ttft_s"] == pytest.approx(0.0025) and stub["runs_s"] == [0.002, 0.003]  # one warm-up, then 2
        assert stub["answer_match"] is False and stub["first_token_kl"] < 1e-6  # the same logits, another answer
        assert fp32["reused_tokens"] == 0 and fp32["answer_match"] and fp32["first_token_kl"] < 1e-6
        assert row["peers"]["hf-prefix-fp32"]["reused_tokens"] > 0
        assert row["peers"]["cbr-full-reuse"]["reuse_share"] > 0.5
    assert peers["stub"]["answers_matching"] == "0/2" and peers["hf-fp32"]["answers_matching"] == "2/2"
    assert peers["hf-fp32"]["speedup_vs_hf-fp32"] == 1.0 and "speedup_vs_hf-bf16" in peers["stub"]
    assert peers["cbr-cacheblend@0.15"]["info"]["setting"] == "kv_deviation@0.15"


def test_unknown_peer_is_refused(bench):
    with pytest.raises(SystemExit):
        bench.main(["--peers", "hf-fp32,nonsense"], engine=tiny_engine())


def test_llama_formats_are_named_and_made_once(tmp_path):
    """--llama-format: an unknown format is refused by name; a re-quantized file already there is reused (so no
    llama.cpp is needed to find it)."""
    source = tmp_path / "model.gguf"
    with pytest.raises(ValueError, match="Q4_K.*Q8_0, F16, BF16"):
        peers_module.requantized_gguf(source, "Q4_K", tmp_path)
    made = tmp_path / "model.Q8_0.gguf"
    made.write_bytes(b"GGUF")
    assert peers_module.requantized_gguf(source, "Q8_0", tmp_path) == made
