"""The server's warm-up: before it reports ready it has run the correctness gate, which the first blended
request would otherwise pay (one-time, not in any named part of that request's timings before)."""

from __future__ import annotations

import logging

import pytest

from cacheblend_rag.engine import gate
from cacheblend_rag.server import ServerThread, create_app

pytest.importorskip("fastapi")


def test_the_warm_up_runs_the_correctness_gate_so_no_request_pays_it(tiny_settings, monkeypatch, caplog):
    monkeypatch.setattr(gate, "RESULTS", {})  # as in a new process: this model's gate not yet run
    engine = tiny_settings.service.engine
    assert gate.pending(engine)
    with caplog.at_level(logging.INFO, logger="cacheblend_rag.server.state"):
        with ServerThread(create_app(tiny_settings)):
            assert not gate.pending(engine) and gate.RESULTS[(engine.fingerprint, str(engine.device))][0]
    assert "correctness gate: blending at ratio 1.0 matches full prefill" in caplog.text
