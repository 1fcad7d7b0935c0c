"""The notebook layer: a result live in JupyterLab.

* :mod:`.widget` — :class:`~.widget.PatchGrid` (anywidget): a view of the state the results
  layer makes (:mod:`pipatch._results.views`), nothing else;
* :mod:`.live` — runs an experiment's plan with a live grid, and answers its clicks.

The magics (``%%trace``, ...) are a front end like the CLI: :mod:`pipatch._magics`.
"""
