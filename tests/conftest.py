"""Shared fixtures: the real embedded model, loaded once per test session, and IPython's test
shell with pipatch's magics. This conftest applies to every layer (``tests/unit``,
``tests/integration``, ``tests/e2e``)."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist (make test runs the integration layer as two workers on a two-core machine)
# each worker takes its share of the cores: two workers of two threads each would oversubscribe
# them and run several times slower than one thread each. The processes a test starts (a code()
# script, a notebook's kernel) inherit the share through OMP_NUM_THREADS.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _SHARE = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)

# PIPATCH_TEST_THREADS=n: torch on n threads in every test, with or without workers (another
# float32 summation order: a cheap stand-in for another machine's rounding). It overrides the
# share above and the modules that pick one thread when imported (test_views, test_hostile...);
# a test that sets its own thread count still does (tests/integration/test_progress.py).
_TEST_THREADS = int(os.environ.get("PIPATCH_TEST_THREADS") or 0)
if _TEST_THREADS:
    os.environ["OMP_NUM_THREADS"] = str(_TEST_THREADS)
    torch.set_num_threads(_TEST_THREADS)


def pytest_collection_finish(session):
    """Under PIPATCH_TEST_THREADS, after every test module has been imported: that many threads."""
    if _TEST_THREADS:
        torch.set_num_threads(_TEST_THREADS)


@pytest.fixture(autouse=True)
def _test_threads():
    """Under PIPATCH_TEST_THREADS, each test starts on that many torch threads."""
    if _TEST_THREADS and torch.get_num_threads() != _TEST_THREADS:
        torch.set_num_threads(_TEST_THREADS)

#: The integration modules that take longest, longest first (their tests' seconds summed over a
#: make test run: docs/testing.md, "Where the time goes"). pytest-xdist hands each worker one
#: module at a time (--dist loadfile) in collection order (make test passes
#: --no-loadscope-reorder: xdist's own order puts the modules with most tests first, which are
#: not the longest), so starting the long ones first lets the two workers end together rather
#: than one of them run the last long module alone. An order only: a module not named here runs
#: after these, in the usual order (tests/unit/test_suite_guard.py checks each name exists).
LONGEST_FIRST = ("test_code.py", "test_notebooks.py", "test_lens.py", "test_study.py", "test_ndif.py",
                 "test_faults.py", "test_tracing.py", "test_multitoken.py", "test_patching.py",
                 "test_feature_code.py", "test_feature_trace.py", "test_prefix.py", "test_magics.py")


def pytest_collection_modifyitems(items):
    """The modules of :data:`LONGEST_FIRST` first, in its order; each module's tests keep theirs."""
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)) if "integration" in item.path.parts
               else len(first))


# Under PIPATCH_REQUIRE_VLLM=1 (make test-vllm) a skip fails the run: see tests/_require.py.
# The toy experiment's fixtures (toy_dir, toy) serve the unit and the integration tests alike.
pytest_plugins = ["tests._require", "tests._toy_experiment"]

EIFFEL = "The Eiffel Tower is in the city of"
COLOSSEUM = "The Colosseum is in the city of"
#: Prompts of EIFFEL's length on Gemma 3 (9 tokens): mean ablation's dataset.
MEAN_PROMPTS = [EIFFEL, COLOSSEUM, "The Space Needle is in the city of", "The Louvre Museum is in the city of"]
#: Two pairs of one length (Paris vs Rome), averaged over the last position: a small dataset.
TWO_PAIRS = {"clean": [EIFFEL, "The Louvre is in the city of"], "corrupt": [COLOSSEUM, "The Vatican is in the city of"],
             "answer": " Paris", "foil": " Rome", "positions": [-1]}


@pytest.fixture(scope="session")
def model():
    """The embedded default (Gemma 3 270M, float32, CPU even where there is a GPU) as an nnsight model."""
    from pipatch._backends._load import shared_model

    torch.set_grad_enabled(False)
    return shared_model(device="cpu")


@pytest.fixture(scope="session")
def eiffel_trace(model):
    """The acceptance causal trace: 10 seeds, automatic scale, residual restoration."""
    import pipatch

    return pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris")


@pytest.fixture(scope="session")
def eiffel_patch(model):
    import pipatch

    return pipatch.patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome")


@pytest.fixture(scope="module")
def ip():
    """IPython's test shell (one per process) with pipatch's magics loaded."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "pipatch")
    return shell
