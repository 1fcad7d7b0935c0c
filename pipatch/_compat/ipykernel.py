"""ipykernel's internals that pipatch uses, behind one function.

Checked on ipykernel 7.4.0. Imports nothing (the widget module, :mod:`pipatch._notebook.widget`,
which calls it, imports no pipatch module but the views and this one).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRIVATE_NAMES", "PUBLIC_MODULES", "answer_on_the_front_ends_subshell"]

#: ipykernel's private names used here and nowhere else in pipatch (``tests/unit/test_compat.py``).
PRIVATE_NAMES = ("_reply_subshell_for",)
#: The modules of ipykernel pipatch imports outside this file (``tests/unit/test_compat.py``).
PUBLIC_MODULES = ("ipykernel",)


def answer_on_the_front_ends_subshell(comm: Any) -> None:
    """Let the subshell JupyterLab chose handle ``comm``'s incoming messages.

    Private name: ``BaseComm._reply_subshell_for(data, default)``. ipykernel >= 7.3 routes an
    incoming ``comm_msg`` to the subshell that last *published* on the comm, so that
    request/reply widgets answer the loop that asked. A grid widget is created and updated
    from the main shell, so every click would be routed back to the main shell and wait for
    the running cell to end; the grid has no request/reply traffic, so the method is replaced,
    on this comm only, by one that keeps JupyterLab's choice (``default``). The comm is the
    grid widget's own, which pipatch created: the replacement lives and goes with it. An
    ipykernel without the method routes as JupyterLab says already: nothing to do.
    """
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = lambda data, default: default
