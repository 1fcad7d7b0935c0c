"""pipatch: causal tracing and activation patching for language models, live in JupyterLab.

>>> import pipatch
>>> model = pipatch.load_model()            # embedded Gemma 3 270M, offline
>>> r = pipatch.trace(model, "The Eiffel Tower is in the city of",
...                   subject="Eiffel Tower", answer=" Paris")
>>> r.grid                                   # tensor[layers, tokens], mean normalized recovery

In a notebook: ``%load_ext pipatch`` then ``%%trace --subject ... --answer ...``.
"""

from ._models import PipatchError, load_model
from ._protocols.attribution import attribute
from ._protocols.patching import patch
from ._protocols.paths import path_patch
from ._protocols.tracing import trace
from ._result import Result, load_result

__version__ = "0.1.0"

__all__ = [
    "load_model", "trace", "patch", "attribute", "path_patch", "Result", "load_result", "PipatchError",
    "PatchGrid", "load_ipython_extension", "__version__",
]  # fmt: skip


def load_ipython_extension(ipython) -> None:
    """``%load_ext pipatch``: register the ``%%trace`` and ``%%patch`` cell magics."""
    from ._magics import load_ipython_extension as register

    register(ipython)


def __getattr__(name: str):
    # The widget pulls in anywidget/ipywidgets: imported on first use, not by ``import pipatch``.
    if name == "PatchGrid":
        from ._widget import PatchGrid

        return PatchGrid
    raise AttributeError(f"module 'pipatch' has no attribute {name!r}")


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab finds the prebuilt MIME-renderer extension shipped in this package."""
    return [{"src": "labextension", "dest": "pipatch"}]
