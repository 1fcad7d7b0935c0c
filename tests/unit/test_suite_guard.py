"""The vLLM suites cannot vanish from ``make test``: under ``PIPATCH_REQUIRE_VLLM=1`` a skip fails.

Each case runs a tiny pytest in a subprocess on a file of its own (in a temporary folder, so no
conftest of this repository is read), with the plugin of ``tests/_require.py`` loaded by ``-p``,
once with the variable and once without: without it a skip stays a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._require import REQUIRE

ROOT = Path(__file__).resolve().parents[2]

PASSES = "def test_passes():\n    assert True\n"
MISSING_MODULE = 'import pytest\n\npytest.importorskip("a_module_that_does_not_exist")\n\n\ndef test_never():\n    pass\n'
SKIPS_INSIDE = 'import pytest\n\n\ndef test_skips():\n    pytest.skip("no accelerator")\n'
ONLY_XFAIL = 'import pytest\n\n\n@pytest.mark.xfail(strict=True)\ndef test_fails():\n    assert False\n'


def run_pytest(tmp_path: Path, files: dict[str, str], require: bool) -> subprocess.CompletedProcess:
    """Run pytest on ``files`` (name → source) in ``tmp_path``, with or without ``PIPATCH_REQUIRE_VLLM=1``."""
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if k != REQUIRE}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if require:
        env[REQUIRE] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests._require", "-p", "no:cacheprovider", *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_module_that_skips_at_import_fails_when_required(tmp_path):
    files = {"test_ok.py": PASSES, "test_missing.py": MISSING_MODULE}
    done = run_pytest(tmp_path, files, require=True)
    assert done.returncode != 0, done.stdout
    assert "forbids skips" in done.stdout and "a_module_that_does_not_exist" in done.stdout, done.stdout
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout


def test_a_module_that_skips_at_import_still_skips_outside_make_test(tmp_path):
    files = {"test_ok.py": PASSES, "test_missing.py": MISSING_MODULE}
    done = run_pytest(tmp_path, files, require=False)
    assert done.returncode == 0, done.stdout
    assert re.search(r"1 passed, 1 skipped", done.stdout), done.stdout


@pytest.mark.parametrize("require", [True, False])
def test_a_test_that_skips_fails_only_when_required(tmp_path, require):
    done = run_pytest(tmp_path, {"test_ok.py": PASSES, "test_skip.py": SKIPS_INSIDE}, require=require)
    if require:
        assert done.returncode == 1, done.stdout
        assert "1 failed, 1 passed" in done.stdout and "no accelerator" in done.stdout, done.stdout
    else:
        assert done.returncode == 0, done.stdout
        assert "1 passed, 1 skipped" in done.stdout, done.stdout


@pytest.mark.parametrize("require", [True, False])
def test_a_run_where_nothing_passed_fails_only_when_required(tmp_path, require):
    # An expected failure is no skip, but a required run that passed nothing proved nothing.
    done = run_pytest(tmp_path, {"test_xfail.py": ONLY_XFAIL}, require=require)
    assert "1 xfailed" in done.stdout, done.stdout
    assert (done.returncode != 0) == require, done.stdout


def recipe(makefile: str, target: str) -> list[str]:
    """The recipe lines (tab-indented, continuations joined) of ``target`` in ``makefile``."""
    lines = makefile.replace("\\\n", " ").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}:(?!.*export)", line))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        body.append(line.strip())
    return body


def prerequisites(makefile: str, target: str) -> list[str]:
    """The targets ``target`` depends on (its rule line's names after the colon)."""
    line = next(line for line in makefile.replace("\\\n", " ").splitlines()
                if re.match(rf"{re.escape(target)}:(?!.*export)", line))
    return [name for name in line.split(":", 1)[1].split() if not name.startswith("$(")]


def reached(makefile: str, target: str) -> list[str]:
    """The recipe lines of ``target`` and of every target it reaches, through its
    prerequisites and the ``$(MAKE) ... NAME`` lines of its recipe (make test runs its layers
    as targets of their own, two jobs at a time)."""
    seen: set[str] = set()
    lines: list[str] = []

    def visit(name: str) -> None:
        if name in seen or not re.search(rf"^{re.escape(name)}:", makefile, re.M):
            return
        seen.add(name)
        for before in prerequisites(makefile, name):
            visit(before)
        body = recipe(makefile, name)
        lines.extend(body)
        for line in body:
            if line.startswith("$(MAKE)"):
                for word in line.split()[1:]:
                    if not word.startswith("-"):
                        visit(word)

    visit(target)
    return lines


def test_make_test_runs_every_suite_and_requires_the_vllm_ones():
    makefile = (ROOT / "Makefile").read_text()
    test = reached(makefile, "test")
    assert "npm test" in test
    assert any("-m pytest" in line and '-m "not vllm"' in line for line in test), test
    assert any(line.startswith("$(MAKE)") and line.endswith(" test-vllm") for line in test), test
    for layer in ("tests/unit", "tests/integration", "tests/e2e"):  # each layer in a pytest of its own
        assert any("-m pytest" in line and layer in line.split() for line in test), (layer, test)
    # The four vLLM suites, each in a pytest of its own, under the variable the plugin reads.
    assert re.search(rf"^test-vllm: export {REQUIRE} := 1$", makefile, re.M)
    vllm = reached(makefile, "test-vllm")
    suites = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"^pytestmark = pytest\.mark\.vllm$", p.read_text(encoding="utf-8"), re.M))
    assert {"tests/integration/test_vllm.py", "tests/integration/test_vllm_kernel.py", "tests/integration/test_vllm_tp.py",
            "tests/integration/test_served.py"} <= set(suites)
    for suite in suites:
        assert any(line.startswith("$(VPY) -m pytest") and line.endswith(suite) for line in vllm), (suite, vllm)
        assert f"--ignore={suite}" in " ".join(test), f"the plain pytest run must --ignore {suite}"


def test_conftest_loads_the_plugin():
    # Without it the variable would be read by nobody and the suites could skip again.
    import tests.conftest

    assert "tests._require" in tests.conftest.pytest_plugins


def test_the_longest_first_order_names_integration_modules_that_exist():
    from tests.conftest import LONGEST_FIRST

    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    for name in LONGEST_FIRST:
        assert (ROOT / "tests" / "integration" / name).is_file(), f"tests/conftest.py LONGEST_FIRST names {name}: gone"
