"""pipatch: causal tracing and activation patching for language models, live in JupyterLab.

>>> import pipatch
>>> model = pipatch.load_model()            # embedded Gemma 3 270M, offline
>>> r = pipatch.trace(model, "The Eiffel Tower is in the city of",
...                   subject="Eiffel Tower", answer=" Paris")
>>> r.grid                                   # tensor[layers, tokens], mean normalized recovery
>>> pipatch.compare(r, other).grid           # a − b, cell by cell, of two results

In a notebook: ``%load_ext pipatch`` then ``%%trace --subject ... --answer ...`` (also
``%%patch``, ``%%attribute``, ``%%path_patch``, ``%%lens``, ``%%circuit``, and ``%%compare a b``); in
a shell: ``pipatch trace | patch | attribute | path-patch | lens | circuit | compare``; live without magics:
``pipatch.PatchGrid.run(model, "patch", ...)``. Many facts at once, into a durable store:
``pipatch.study(model, pipatch.known_facts(), store="known.sqlite")`` (``pipatch study``, ``%study``;
``known_facts()`` is ROME's ``known_1000.json``, shipped). Circuits: ``pipatch.circuit(model,
**pipatch.tasks.ioi(32, tokenizer=model.tokenizer))`` scores every edge by EAP-IG, checks the
top ones by exact edge patches and measures the faithfulness curve; ``result.edges()``.

The experiment functions (``trace``, ``patch``, ``attribute``, ``path_patch``, ``lens``, ``circuit``, and any
an installed package registers) are derived from their declarations
(:mod:`pipatch.extend` declares them): one per registered experiment of :mod:`pipatch._experiments._registry`.
"""

from . import extend as extend  # pipatch.extend: the public extension module
from . import tasks
from ._backends._load import load_model
from ._experiments import _api
from ._experiments._feature_corpus import feature_contexts
from ._model.features import embedded_sae, load_sae, load_saes
from ._model.features.labels import load_labels
from ._model.models import PipatchError
from ._results.compare import compare
from ._results.plot import plot
from ._results.result import Result, load_result
from ._studies import Study, known_facts, load_study, study

__version__ = "0.1.0"

globals().update(_api.functions())

__all__ = [
    "load_model", "load_sae", "load_saes", "embedded_sae", "load_labels", "feature_contexts", *_api.functions(), "compare", "plot", "Result", "load_result",
    "PipatchError",
    "study", "load_study", "Study", "known_facts", "tasks",
    "PatchGrid", "load_ipython_extension", "__version__",
]  # fmt: skip


def load_ipython_extension(ipython) -> None:
    """``%load_ext pipatch``: register one cell magic per experiment of :mod:`pipatch._experiments._registry`
    (``%%trace``, ``%%patch``, ``%%attribute``, ``%%path_patch``, ``%%lens``, ...) and ``%%compare``."""
    from ._magics import load_ipython_extension as register

    register(ipython)


def __getattr__(name: str):
    # The widget pulls in anywidget/ipywidgets: imported on first use, not by ``import pipatch``.
    if name == "PatchGrid":
        from ._notebook.live import PatchGrid

        return PatchGrid
    if name in _api.functions():  # an experiment registered after import
        return _api.function(name)
    raise AttributeError(f"module 'pipatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too: Jupyter's completion and the API reference's inspection list dir(pipatch).
    return sorted({*globals(), "PatchGrid", *_api.functions()})


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab finds the prebuilt MIME-renderer extension shipped in this package."""
    return [{"src": "labextension", "dest": "pipatch"}]
