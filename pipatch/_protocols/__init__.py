"""The protocols: what to run. Each turns a researcher's question into engine sweeps.

* :mod:`.tracing` — ROME causal tracing: noise the subject, restore clean states.
* :mod:`.patching` — activation patching between a clean and a corrupt prompt.
"""
