"""pipatch's error and warning: the one-line kinds every module raises or warns with.

A leaf module (it imports nothing of pipatch), so that the lowest modules, the third-party
compat layer (:mod:`pipatch._compat`) among them, can raise them too.
"""

from __future__ import annotations

__all__ = ["PipatchError", "PipatchWarning"]


class PipatchError(ValueError):
    """A problem with the caller's input or environment, explained in one line.

    The CLI and the magics print ``str(error)`` alone (no traceback): the message names the
    problem and the fix.
    """


class PipatchWarning(UserWarning):
    """Something that may make results wrong or runs fail, said in one line, once: a library
    version pipatch was not tested with (:func:`pipatch._compat.warn_untested`).
    ``warnings.filterwarnings("ignore", category=PipatchWarning)`` silences them."""
