"""anyio's internals that pipatch uses, behind one function.

Checked on anyio 4.16.0.
"""

from __future__ import annotations

from . import missing

__all__ = ["PRIVATE_NAMES", "PUBLIC_MODULES", "import_before_nnsight"]

#: anyio's private names used here and nowhere else in pipatch (``tests/unit/test_compat.py``).
PRIVATE_NAMES = ("_asyncio",)
#: The modules of anyio pipatch imports outside this file (``tests/unit/test_compat.py``).
PUBLIC_MODULES = ("anyio",)


def import_before_nnsight() -> None:
    """Import the parts of anyio that it imports on first use, before anything imports nnsight.

    Private name: the module ``anyio._backends._asyncio``. anyio imports it (and ``anyio.abc``)
    lazily, on the first use of its streams or thread pool (an HTTP middleware's, a sync
    route's), and those imports fail once nnsight is imported ("Attribute 'save' is missing
    its type annotation"). ``pipatch serve`` calls this first."""
    try:
        import anyio._backends._asyncio  # noqa: F401
        import anyio.abc  # noqa: F401
    except ImportError:
        raise missing("anyio", "_backends._asyncio", checked="4.16.0") from None
