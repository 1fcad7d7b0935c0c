"""The unit layer loads no model: a test here that builds one, runs one, or asks for one fails.

While each test of ``tests/unit`` runs (its fixtures' setup included), torch's global module
hooks watch this process: a parameter registered on any ``torch.nn.Module`` (a model being
built: random weights, ``from_pretrained``, nnsight's meta-device copy) or any module's forward
(a model already built, such as the session's embedded model, being run). A test that requests
a fixture of the root conftest that holds a model (``model``, ``eiffel_trace``,
``eiffel_patch``) fails before it starts. Such a test belongs in ``tests/integration``.

What a test's subprocess does is not watched: the unit tests that start a process (the CLI's
usage error, a hub check, a pytest of their own) start one that loads no model.
"""

from __future__ import annotations

import pytest
from torch.nn.modules.module import register_module_forward_pre_hook, register_module_parameter_registration_hook

#: The root conftest's fixtures that hold (and load) the embedded model.
MODEL_FIXTURES = ("model", "eiffel_trace", "eiffel_patch")

_WATCHED = pytest.StashKey[tuple[list[str], list]]()


def _watch(item: pytest.Item) -> None:
    seen: list[str] = []
    handles = [
        register_module_parameter_registration_hook(
            lambda module, name, param: seen.append(f"built {type(module).__name__}.{name}")),
        register_module_forward_pre_hook(lambda module, args: seen.append(f"ran {type(module).__name__}")),
    ]
    item.stash[_WATCHED] = (seen, handles)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture is set up (a module-scoped fixture that builds a model is seen too)."""
    asked = [name for name in MODEL_FIXTURES if name in item.fixturenames]
    if asked:
        pytest.fail(f"a unit test asks for the model ({', '.join(asked)}): move it to tests/integration",
                    pytrace=False)
    _watch(item)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        result = yield
    finally:
        seen, handles = item.stash.get(_WATCHED, ([], []))
        for handle in handles:
            handle.remove()
    if seen:
        shown = ", ".join(dict.fromkeys(seen[:20]))
        pytest.fail(f"a unit test loads no model, but this one did ({shown}): move it to tests/integration",
                    pytrace=False)
    return result
