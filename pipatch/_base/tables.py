"""One place builds the pandas tables pipatch returns (``frame()``, ``edges()``, ``facts()``).

Text columns keep Python's own strings (pandas' ``string_storage="python"``): a token may be
any Python string, a lone surrogate of a byte-level tokenizer included, which the Arrow-backed
strings pandas picks wherever pyarrow is installed refuse (UnicodeEncodeError). The table is
the same with or without pyarrow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["table"]


def table(rows: Sequence[Any], columns: Sequence[str] | None = None) -> Any:
    """A pandas DataFrame of ``rows`` (dicts, or sequences in the order of ``columns``)."""
    import pandas as pd

    with pd.option_context("mode.string_storage", "python"):
        return pd.DataFrame(rows, columns=columns)
