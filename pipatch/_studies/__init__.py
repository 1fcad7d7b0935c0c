"""Studies: one experiment over many facts, stored durably, averaged by named position.

:func:`study` runs, :func:`load_study` reads back (no model needed), :class:`Study` is what
both return. Running and reading are apart, and meet only in the store:

* :mod:`._run`: the protocol of a run (ROME's ``main()``): the loop over facts, the facts in
  flight (a chain in this process, threads on a served model), the commits, resume, and how
  a run fails;
* :mod:`._known`: ROME's known-fact rule, read off each planner's own clean run;
* :mod:`._facts`: the inputs (ROME's JSON, JSONL, CSV, Parquet, pandas, ``datasets``);
* :mod:`._store`: the SQLite store a killed run leaves whole;
* :mod:`._read`: the :class:`Study`, the store read back: facts, results, averages, tables,
  plots; :mod:`._aggregate` the averages and intervals; :mod:`._view` the live view;
* :mod:`._front`: the flags the CLI and the ``%study`` magic read.
"""

from ._facts import known_facts
from ._known import known_fact
from ._read import Study, load_study
from ._run import study

__all__ = ["study", "load_study", "Study", "known_fact", "known_facts"]
