"""pipatch's error and warning: the one-line kinds every module raises or warns with.

A leaf module (it imports nothing of pipatch), so that the lowest modules, the third-party
compat layer (:mod:`pipatch._compat`) among them, can raise them too.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["PipatchError", "PipatchWarning", "warn"]


class PipatchError(ValueError):
    """A problem with the caller's input or environment, explained in one line.

    The CLI and the magics print ``str(error)`` alone (no traceback): the message names the
    problem and the fix.
    """


class PipatchWarning(UserWarning):
    """Something that may make results wrong or runs fail, said in one line, once: a library
    version pipatch was not tested with (:func:`pipatch._compat.warn_untested`).
    ``warnings.filterwarnings("ignore", category=PipatchWarning)`` silences them."""


def warn(line: str) -> None:
    """Warn ``line`` as a :class:`PipatchWarning` from the first caller outside pipatch (the
    researcher's line that ran the experiment, not the engine's), so the location Python prints
    beside it is theirs."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # pipatch/, not _base/
    frame, level = sys._getframe(1), 2  # level 1 is this line; 2 the caller of warn()
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(line, PipatchWarning, stacklevel=level)
