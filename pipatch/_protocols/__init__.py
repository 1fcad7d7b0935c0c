"""The protocols: what to run. Each turns a researcher's question into a Plan of cells.

* :mod:`.tracing` — ROME causal tracing: noise the subject, restore clean states.
* :mod:`.patching` — activation patching between a clean and a corrupt prompt.
* :mod:`.attribution` — attribution patching: every cell estimated from one backward pass,
  the top cells verified by real patches.
* :mod:`.paths` — path patching: each sender's effect through chosen receivers only.
* :mod:`.dataset` — any of them over many prompts, averaged over named positions.

A protocol module checks its inputs (one :class:`~pipatch.PipatchError` line each), runs the
baselines through a backend (``backend.capture``) and returns a :class:`~pipatch._engine.Plan`:
the :class:`~pipatch.Result` to fill and the sweeps whose cells fill it. It never opens a trace
itself. A new experiment is one module here plus one entry in :mod:`pipatch._registry`.
"""
