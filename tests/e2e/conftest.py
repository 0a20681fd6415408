import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest

import harness


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    harness.STOPPED_REPORTS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        reports = harness.STOPPED_REPORTS + [e._report() for e in harness.LIVE_ENVOYS]
        text = "\n---\n".join(r for r in reports if r) or "(nothing)"
        report.sections.append(("Envoy warnings and picker health/scrape series at stop", text))
