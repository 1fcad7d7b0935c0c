"""A circuit's graph lives in one module (``pipatch/_graph.py``): its nodes are typed by site,
its indices are the ones the hand formulas gave, and no other module compares node kinds.

* **The grep test.** No module of ``pipatch/`` but ``_graph.py`` and ``_sites.py`` compares a
  circuit node-kind string (``"emb"``, ``"head_out"``, ``"mlp_out"``, ``"qkv"``,
  ``"mlp_in"``, ``"logits"``): read with :mod:`ast`, so prose and the code templates of
  ``Result.code()`` (string literals) are never read as code. Flagged: such a literal (alone or
  in a tuple, list or set) on either side of a comparison (``==``, ``!=``, ``in``, ``is``) or
  after ``case``; as a key of a dict literal (a kind map); as a subscript (a lookup by kind);
  as the key of ``.get`` / ``.index`` / ``.count`` / ``.pop`` / ``.setdefault`` /
  ``.startswith`` / ``.endswith``. The one spelling shared with something else: ``qkv`` is an
  :class:`~pipatch._models.Adapter` field too (the q/k/v projection modules), so a dict of
  adapter fields may have it as a key.
* **Indices.** Every index :class:`pipatch._graph.Graph` gives equals the formula the backends
  computed by hand before (``per_layer = 3 * H + 1``, ``sender = 1 + layer * (H + 1)``, ...),
  the valid-edge mask equals the old string-kind loop, and the stacked writes and gradients
  the old orderings.
* **Names and files.** Node names are what they were; :func:`pipatch._graph.named` reads them
  back; a circuit's file written as a plain result (as pipatch wrote them before
  :class:`~pipatch._circuit_result.CircuitResult`) loads as one, drawn the same.
"""

from __future__ import annotations

import pytest

from pipatch._models import PipatchError
from pipatch._sites import LOGITS, SITES


def test_the_logits_are_a_kin_of_a_site_and_no_grids():
    from pipatch._models import adapter_for
    from pipatch._sites import site
    from tests._tiny import tiny_hf_model

    assert LOGITS not in SITES.values() and LOGITS.reads_input
    with pytest.raises(PipatchError, match="unknown site"):
        site("logits")
    hf = tiny_hf_model("llama")
    assert LOGITS.module(adapter_for(hf), hf, 0) is hf.model.norm  # the final norm: its input is read
