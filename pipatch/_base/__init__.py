"""The base layer: what every other layer may use, importing nothing of pipatch above it.

* :mod:`.errors` — :class:`~.errors.PipatchError` and the one-line warning;
* :mod:`.checks` — checks of a caller's values (a whole number, a probability, ...), each one
  error line naming the value and the fix;
* :mod:`.known` — what pipatch knows about a model it loaded (name, backend), kept beside the
  model rather than on it;
* :mod:`.threads` — the worker threads a run starts, stopped with it;
* :mod:`.progress` — progress bars (tqdm);
* :mod:`.tables` — pandas frames, pandas imported on first use;
* :mod:`.scales` — the noise scales a result records.

The layers, bottom first (a module imports only from its own package or lower ones;
``tests/unit/test_layers.py`` checks it): ``_base``, ``_compat``, ``_model``, ``_programs``,
``_backends``, ``_engine``, ``_results``, ``_experiments``, ``_notebook``, ``_studies``,
``_serving``, then the top level (``pipatch``'s public API, ``cli``, ``_magics``, ``tasks``).
"""
