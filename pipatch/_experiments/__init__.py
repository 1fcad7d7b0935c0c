"""The experiments: what to run. Each turns a researcher's question into a Plan of cells.

* :mod:`.tracing` — ROME causal tracing: noise the subject, restore clean states.
* :mod:`.patching` — activation patching between a clean and a corrupt prompt.
* :mod:`.attribution` — attribution patching: every cell estimated from one backward pass,
  the top cells verified by real patches.
* :mod:`.paths` — path patching: each sender's effect through chosen receivers only.
* :mod:`.lens` — the logit lens: every layer's residual stream read through the model's head.
* :mod:`.dataset` — any of them over many prompts, averaged over named positions.

An experiment module checks its inputs (one :class:`~pipatch.PipatchError` line each), runs the
baselines through a backend (``backend.capture``) and returns a :class:`~pipatch._engine.Plan`:
the :class:`~pipatch.Result` to fill and the sweeps whose cells fill it. It never opens a trace
itself. Each experiment module also holds its ``DECLARATION`` (:class:`pipatch._model.declare.Experiment`:
parameters, planner, title, code template), from which its function, command, magic and
``PatchGrid.run`` entry are derived: a new experiment is one module here plus its name in
:mod:`._registry`'s list (another package's: an entry point instead).

Beside them: :mod:`._registry` (the experiments by name), :mod:`._api` (the public functions
derived from the declarations), the feature analyses (:mod:`._feature_screen`: screening
latents by attribution; :mod:`._feature_contexts` and :mod:`._feature_corpus`: a latent's top
contexts over a corpus), and each experiment's private helpers (``_inputs``, ``_*_code``, ...).
"""
