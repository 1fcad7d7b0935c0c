"""A pytest plugin: under ``PIPATCH_REQUIRE_VLLM=1`` a skip is a failure, and so is a run of nothing.

The vLLM and served suites begin with ``pytest.importorskip("vllm")`` so that a developer
without vLLM can run plain ``pytest``. ``make test-vllm`` builds the environment those suites
need and sets ``PIPATCH_REQUIRE_VLLM=1``: there, a skip means the environment is broken (an
``import vllm`` that fails, a missing ``psutil``), and ~40 backend-parity tests would vanish
from a green run. This plugin turns every skip (at collection or in a test) into a failure,
and fails a session in which no test passed.

``tests/conftest.py`` loads it (``pytest_plugins``); a pytest run without that conftest loads
it with ``-p tests._require``.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = "PIPATCH_REQUIRE_VLLM"


def required() -> bool:
    """Whether this run must not skip: ``PIPATCH_REQUIRE_VLLM`` is set to anything but ``""``/``0``."""
    return os.environ.get(REQUIRE, "") not in ("", "0")


def _reason(longrepr) -> str:
    # A skip's longrepr is (path, line, "Skipped: why"); keep only the why.
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_skip(report) -> None:
    """Turn a skipped report into a failed one that says why and how to fix it."""
    report.outcome = "failed"
    report.longrepr = (
        f"skipped, but {REQUIRE}=1 (make test-vllm) forbids skips: {_reason(report.longrepr)}. "
        "Install what the suite needs (make install-vllm) and check that `import vllm` works in that venv."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips itself at import (``importorskip``) fails collection instead."""
    outcome = yield
    report = outcome.get_result()
    if required() and report.skipped:
        _fail_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skips (not an expected failure) fails instead."""
    outcome = yield
    report = outcome.get_result()
    if required() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report)


def pytest_sessionfinish(session, exitstatus):
    """A required run in which no test passed fails, even if nothing failed (all deselected, say)."""
    if not required():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    passed = len(reporter.stats.get("passed", [])) if reporter is not None else session.testscollected
    if passed == 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say why a required run with no passing test failed, where the summary is read."""
    if required() and not terminalreporter.stats.get("passed"):
        terminalreporter.write_line(f"{REQUIRE}=1: no test passed; this run must run its tests, not skip them.", red=True)
