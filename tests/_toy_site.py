"""A site that encodes and decodes, built the way a new site is (the ``_sites`` contract), in
a module of its own written to a temporary folder: the residual stream times two, written
back halved. Patching with it must give the residual stream's own grid (the hook reference
of ``tests/_reference.patch_grid``), on every backend, with no pipatch file changed."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

SOURCE = textwrap.dedent('''
    """A toy site: the residual stream times two, written back halved."""
    from pipatch.extend import Site


    class Doubled(Site):
        """The block's output, doubled: ``encode(x) = 2x``, ``decode(v) = v / 2``."""

        def encode(self, raw):
            return raw * 2

        def decode(self, value):
            return value / 2


    DOUBLED = Doubled("doubled", order=8, holder="block", sublayer=False, about="the residual stream times two")
''')


def import_source(folder: Path, name: str, source: str):
    """Write ``source`` as module ``name`` into ``folder`` and import it (kept in
    ``sys.modules``, so what pickles its objects by reference finds them); the module."""
    path = Path(folder) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def toy_site(folder: Path):
    """Write the toy site's module into ``folder``, import it and return its site."""
    return import_source(folder, f"toy_site_{abs(hash(str(folder)))}", SOURCE).DOUBLED
