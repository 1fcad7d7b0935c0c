"""The results layer: what a run leaves, and every way it is shown or saved.

* :mod:`.result` — :class:`~.result.Result`: tensors, labelled axes, metadata and the one view
  state; saving and loading (safetensors + JSON);
* :mod:`.code` — :meth:`Result.code() <pipatch.Result.code>`: the script that reruns a result;
* :mod:`.compare` — :func:`pipatch.compare`: two results cell by cell;
* :mod:`.plot` — :func:`pipatch.plot`;
* :mod:`.circuit`, :mod:`.features`, :mod:`.feature_circuit` — the circuit, latent and feature
  circuit results;
* :mod:`.views` — text, matplotlib/PNG and the MIME bundle, all drawn from the view state
  (the widget, :mod:`pipatch._notebook.widget`, draws the same state in the browser).

A result is made by an experiment (:mod:`pipatch._experiments`) and never runs a model.
"""
