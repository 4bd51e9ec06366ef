"""``make audit``: pip-audit over the virtualenv this runs in, saying plainly what it could not do.

pip-audit prints a stack trace when its vulnerability service cannot be reached, and a table of skipped
packages that looks like a pass when the service knows none of them (a mirror's JSON API, say). This runs it
(``--skip-editable``: this repo's own packages are on no index) and answers in one of four ways:

* exit 0: every package the service knows was audited, no known vulnerability (those it does not know named);
* exit 1: known vulnerabilities, one line each (package, version, id and aliases, fixed versions);
* exit 2: the service could not be reached, or knew none of the packages: nothing was audited.

``--ignore ID`` (repeatable) leaves out an advisory that does not apply, as docs/dependencies.md says why.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# What requests and urllib3 say when a host cannot be reached (refused, no route, no DNS, a proxy, a timeout).
_UNREACHABLE = re.compile(r"ConnectionError|ProxyError|ConnectTimeout|ReadTimeout|Max retries exceeded|"
                          r"NameResolutionError|Failed to establish a new connection|Temporary failure in name "
                          r"resolution|ServiceError|SSLError")
NOTHING_AUDITED = 2


def run_pip_audit(service: str, ignored: list[str], timeout: int) -> tuple[int, str, dict | None]:
    """pip-audit's exit code, its stderr and its JSON report (``None`` when it wrote none)."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "audit.json"
        command = [sys.executable, "-m", "pip_audit", "--skip-editable", "--progress-spinner", "off", "-f", "json",
                   "-o", str(report), "-s", service, "--timeout", str(timeout)]
        for vuln in ignored:
            command += ["--ignore-vuln", vuln]
        done = subprocess.run(command, capture_output=True, text=True)
        data = json.loads(report.read_text()) if report.exists() and report.stat().st_size else None
    return done.returncode, done.stderr, data


def last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    found = [line for line in lines if _UNREACHABLE.search(line)]
    return (found or lines or ["no output"])[-1][:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", default="pypi", choices=("pypi", "osv"),
                        help="the vulnerability service pip-audit asks (default: pypi)")
    parser.add_argument("--ignore", action="append", default=[], metavar="ID",
                        help="an advisory id (or alias) that does not apply; repeatable")
    parser.add_argument("--timeout", type=int, default=15, help="seconds per request to the service")
    args = parser.parse_args(argv)

    try:
        import pip_audit  # noqa: F401
    except ImportError:
        print("audit: pip-audit is not installed in this virtualenv (the dev extra has it; make install)")
        return NOTHING_AUDITED
    code, stderr, data = run_pip_audit(args.service, args.ignore, args.timeout)
    if data is None or _UNREACHABLE.search(stderr):
        why = last_error_line(stderr)
        print(f"audit: the vulnerability service ({args.service}) could not be reached, so nothing was audited: "
              f"{why}\naudit: check the network (or proxy); --service osv asks another service")
        return NOTHING_AUDITED
    packages = data.get("dependencies", [])
    audited = [p for p in packages if "skip_reason" not in p]
    skipped = [p for p in packages if "skip_reason" in p]
    if not audited:
        print(f"audit: the vulnerability service ({args.service}) knew none of the {len(packages)} packages "
              f"(\"{skipped[0]['skip_reason'] if skipped else 'none installed'}\"...), so nothing was audited: "
              "is pip's index a mirror? --service osv asks another service")
        return NOTHING_AUDITED
    found = [(p, v) for p in audited for v in p.get("vulns", [])]
    for package, vuln in found:
        aliases = ", ".join(vuln.get("aliases", []))
        fixes = ", ".join(vuln.get("fix_versions", [])) or "no fixed release"
        print(f"{package['name']} {package['version']}: {vuln['id']}{f' ({aliases})' if aliases else ''}; "
              f"fixed in: {fixes}")
    unknown = f"; not known to the service: {', '.join(p['name'] for p in skipped)}" if skipped else ""
    ignored = f"; ignored: {', '.join(args.ignore)}" if args.ignore else ""
    print(f"audit: {len(audited)} packages audited against {args.service}, {len(found)} known "
          f"vulnerabilities{ignored}{unknown}")
    return 1 if found or code not in (0, 1) else 0


if __name__ == "__main__":
    sys.exit(main())
