"""The public experiment functions and their planners (INTERIM shim while the core is rebuilt).

Contract (stable):

* ``plan_trace / plan_patch / plan_attribute / plan_path_patch(model, **kwargs) -> Plan``
  check the inputs (one-line :class:`PipatchError`), run the baselines and return a Plan.
  ``model`` may be a loaded nnsight model or anything :func:`load_model` takes (None, a name,
  a folder).
* ``plan.result``: the Result being filled; ``plan.run(*, on_row=None, stop=None) -> Result``;
  ``plan.predictor()``: a callable ``(view, row, col, seed, k) -> [(token, prob), ...]`` that
  holds no reference to the result; ``plan.total_rows``.
"""

from __future__ import annotations

from typing import Any

from ._models import shared_model


def resolve_model(model: Any):
    """A loaded model as is; ``None``, a name or a folder through :func:`shared_model`."""
    if model is None or isinstance(model, str) or hasattr(model, "__fspath__"):
        return shared_model(None if model is None else str(model))
    return model


def plan_trace(model, prompt, **kwargs):
    from ._protocols.tracing import plan_trace as planner

    model = resolve_model(model)
    return _bind(planner(model, prompt, **kwargs), model)


def plan_patch(model, **kwargs):
    from ._protocols.patching import plan_patch as planner

    model = resolve_model(model)
    return _bind(planner(model, **kwargs), model)


def plan_attribute(model, **kwargs):
    raise NotImplementedError("interim: attribution plans land with the core rewrite")


def plan_path_patch(model, **kwargs):
    raise NotImplementedError("interim: path patching plans land with the core rewrite")


def _bind(plan, model):
    plan.model = model
    return plan
