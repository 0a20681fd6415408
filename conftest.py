"""Skip policy for every pytest run in this repository (pytest.ini beside this file makes the
repository root pytest's rootdir, so this conftest is loaded by `make deploy-check`, `make e2e`,
`make bench-envoy-check` and any `pytest <path>` run from inside the repository).

A skipped test is a check that did not run, and `make test` passing with one is a silent hole.
So a run in which any test (or a whole module, e.g. through `pytest.importorskip`) is skipped
fails, unless the skip is listed in ALLOWED_SKIPS below with the reason it is acceptable. The
skip count is always printed, with each skip's reason (`-ra` in pytest.ini prints the reasons in
the short summary too).

An xfail (or an xpass) fails the run too: a test marked as expected to fail is a known bug
shipped behind a check that cannot fail. Fix the bug, or withdraw the feature and its test.
Under pytest-xdist the check runs in the controller, which sees every worker's reports.

ALLOWED_SKIPS is empty on purpose: every skip in tests/ and tools/ is a missing prerequisite that
the Makefile installs (`make venv`, `make wrk`), so a skip means the environment is broken and
the run must say so. Add an entry only for a skip that is right on a correctly set-up machine,
keyed by the test's node id (a prefix matches, so a module's or class's id covers its tests),
with the reason.
"""
from __future__ import annotations

import pytest

# node id (or node-id prefix) -> why skipping it is acceptable on a machine set up by `make`.
ALLOWED_SKIPS: dict[str, str] = {}

_skips: list[tuple[str, str]] = []


def _reason(report) -> str:
    longrepr = report.longrepr
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _allowed(nodeid: str) -> str | None:
    for key, why in ALLOWED_SKIPS.items():
        if nodeid == key or nodeid.startswith(key + "::") or nodeid.startswith(key + "["):
            return why
    return None


_xfails: list[tuple[str, str]] = []


def _record(report) -> None:
    # An xfail is reported as `skipped` with `wasxfail` set, an xpass as passed with it set.
    if hasattr(report, "wasxfail"):
        if report.when == "call" or report.skipped:
            _xfails.append((report.nodeid or str(report.fspath), str(report.wasxfail)))
    elif report.skipped:
        _skips.append((report.nodeid or str(report.fspath), _reason(report)))


def pytest_runtest_logreport(report):
    _record(report)


def pytest_collectreport(report):
    # A module skipped at import (pytest.importorskip, pytest.skip(allow_module_level=True)).
    _record(report)


def _violations() -> list[tuple[str, str]]:
    return [(n, r) for n, r in _skips if _allowed(n) is None]


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _is_xdist_worker(session.config):
        return
    if (_violations() or _xfails) and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_xdist_worker(config):
        return
    tr = terminalreporter
    bad = _violations()
    allowed = len(_skips) - len(bad)
    tr.write_line(f"skip policy: {len(_skips)} skipped ({allowed} allowed, {len(bad)} not allowed)")
    for nodeid, reason in _skips:
        why = _allowed(nodeid)
        tag = f"allowed: {why}" if why is not None else "NOT ALLOWED"
        tr.write_line(f"  SKIPPED {nodeid}: {reason} [{tag}]")
    for nodeid, reason in _xfails:
        tr.write_line(f"  XFAIL/XPASS {nodeid}: {reason} [NOT ALLOWED: no known bug ships behind xfail]",
                      red=True, bold=True)
    if bad:
        tr.write_line(
            "skip policy: FAILED: a skipped test is a check that did not run. Install what it needs "
            "(the reason above says what), or list it in ALLOWED_SKIPS in conftest.py (repository "
            "root) with why skipping it is right.", red=True, bold=True)
