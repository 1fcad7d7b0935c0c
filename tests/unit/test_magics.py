"""The magics in-process: IPython's test shell, real models, real nnsight, no mocks.

One magic per experiment of the registry (``%%trace``, ``%%patch``, ``%%attribute``,
``%%path_patch``); each must give the Python API's numbers. The widget a magic creates is
watched through ipywidgets' own construction hook (``Widget.on_widget_constructed``) and
``observe`` on its traits.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pipatch._experiments._registry import EXPERIMENTS


def test_import_alone_registers_no_magic():
    code = textwrap.dedent(
        """
        from IPython.testing.globalipapp import get_ipython
        ip = get_ipython()
        import pipatch
        assert "trace" not in ip.magics_manager.magics["cell"]
        ip.run_line_magic("load_ext", "pipatch")
        assert {"trace", "patch", "attribute", "path_patch"} <= set(ip.magics_manager.magics["cell"])
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_one_magic_per_experiment_with_its_options_as_help(ip):
    for entry in EXPERIMENTS.values():
        doc = ip.find_cell_magic(entry.name).__doc__
        assert f"%%{entry.name} " in doc  # the usage line
        for option in entry.options:
            assert option.flag in doc
        assert "--model" in doc and "-o" in doc and f"_{entry.name}" in doc and entry.summary in doc
    text = ip.object_inspect_text("%%trace")
    assert "--subject SUBJECT" in text and "Causal tracing" in text
    assert "--sender SENDER" in ip.object_inspect_text("%%path_patch")
