"""A griffe extension for the API reference: pipatch's docstrings cross-reference in Sphinx's
roles (``:func:`pipatch.load_model```), which Markdown would show as written; each becomes the
name in code. Loaded by mkdocs.yml (mkdocstrings' ``extensions`` option)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"``\1``", obj.docstring.value)
