"""The serving layer: ``pipatch serve``, a vLLM engine behind HTTP for pipatch clients.

* :mod:`.serve` — the server: nnsight's ``nnsight-serve`` extended with pipatch's programs;
* :mod:`.guard` — what it lets in: keys, per-request limits, time, turns per client.

The client is a backend (:mod:`pipatch._backends.served`); what both ends agree on (paths,
headers, limits) is :mod:`pipatch._backends._wire`.
"""
