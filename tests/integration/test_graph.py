"""The graph module on a real model: the logits are a kin of a site, never a grid row.

The graph's indices, names and the grep test need no model: ``tests/unit/test_graph.py``.
"""

from __future__ import annotations

import pytest

from pipatch._model.models import PipatchError
from pipatch._model.sites import LOGITS, SITES


def test_the_logits_are_a_kin_of_a_site_and_no_grids():
    from pipatch._model.models import adapter_for
    from pipatch._model.sites import site
    from tests._tiny import tiny_hf_model

    assert LOGITS not in SITES.values() and LOGITS.reads_input
    with pytest.raises(PipatchError, match="unknown site"):
        site("logits")
    hf = tiny_hf_model("llama")
    assert LOGITS.module(adapter_for(hf), hf, 0) is hf.model.norm  # the final norm: its input is read
