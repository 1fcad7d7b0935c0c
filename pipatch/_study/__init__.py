"""Studies: one experiment over many facts, stored durably, averaged by named position.

:func:`study` runs, :func:`load_study` reads back (no model needed), :class:`Study` is what
both return. See :mod:`pipatch._study._study` for the protocol, :mod:`._facts` for the
inputs, :mod:`._store` for the SQLite store, :mod:`._aggregate` for the averages.
"""

from ._facts import known_facts
from ._study import Study, known_fact, load_study, study

__all__ = ["study", "load_study", "Study", "known_fact", "known_facts"]
