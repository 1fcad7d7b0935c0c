"""The model layer: the vocabulary every layer above shares.

* :mod:`.models` — loading the embedded model, and the per-family adapter
  (:class:`~.models.Adapter`): where embeddings, blocks, attention, MLPs, heads and the
  unembedding live;
* :mod:`.sites` — one small type per site (residual, attention, MLP, head, q/k/v, ...): where
  it reads and writes through the adapter, its column axis and labels;
* :mod:`.cells` — a cell (one patched run) as data: its ops, its metric, its base run;
* :mod:`.graph` — a circuit's nodes and edges;
* :mod:`.declare` — how an experiment is declared (:class:`~.declare.Experiment`, its
  parameters), which the experiments fill and the results read;
* :mod:`.features` — the feature primitives: SAE and transcoder weights (:mod:`.features.sae`),
  latent sites (:mod:`.features.site`), where an SAE reads in a model (:mod:`.features.hooks`),
  latent labels (:mod:`.features.labels`), and :func:`~.features.load_sae`.

Nothing here runs a model: programs (:mod:`pipatch._programs`) run in it, backends
(:mod:`pipatch._backends`) carry them.
"""
