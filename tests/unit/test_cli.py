"""The pipatch command and the registry it is built from: every experiment end to end, the
Python API's numbers in ``--json``, datasets, and one-line errors with exit status 2."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

from pipatch import cli
from pipatch._experiments import _api, _registry, paths, tracing
from pipatch._experiments._registry import EXPERIMENTS
from pipatch._model import declare as _declare
from pipatch._model.models import PipatchError
from tests.conftest import COLOSSEUM, EIFFEL

# --------------------------------------------------------------------------------------------
# The registry (no model)
# --------------------------------------------------------------------------------------------


def test_the_registry_lists_every_experiment_once_in_order():
    assert list(EXPERIMENTS) == ["trace", "patch", "attribute", "path_patch", "lens", "circuit", "features",
                                 "feature_patch", "feature_trace", "feature_circuit"]
    assert [e.command for e in EXPERIMENTS.values()] == ["trace", "patch", "attribute", "path-patch", "lens", "circuit",
                                                         "features", "feature-patch", "feature-trace", "feature-circuit"]
    assert {e.prompts.name for e in EXPERIMENTS.values()} == {"prompt", "pair"}
    for entry in EXPERIMENTS.values():
        flags = [o.flag for o in entry.options] + [f for o in entry.options for f in o.alias_flags]
        assert len(flags) == len(set(flags)), entry.name


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_the_options_are_the_python_functions_parameters(name):
    """The function's signature is its declaration's: every flag is a keyword with the same
    default, and only what a shell cannot pass is Python's alone."""
    entry = EXPERIMENTS[name]
    parameters = inspect.signature(getattr(_api, name)).parameters
    python_only = {"model", "fast", "on_row", "stop", "progress", *entry.prompts.every_field}
    assert {o.keyword for o in entry.options} == set(parameters) - python_only
    for option in entry.options:
        default = parameters[option.keyword].default
        if option.required:
            assert default is inspect.Parameter.empty, option.flag
        else:
            assert option.default == default, option.flag
    # help() shows every parameter, with its help line.
    doc = getattr(_api, name).__doc__
    for param in entry.params:
        assert re.search(rf"\n{param.keyword}( : [^\n]+)?\n    {re.escape(param.help)}", doc), param.keyword


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (paths.parse_sender, "12.2", ("head", 12, 2)),
        (paths.parse_sender, "mlp12", ("mlp", 12)),
        (paths.parse_sender, "all", None),
        (paths.parse_sender, "MLP", "mlp"),
        (paths.parse_receivers, "logits", "logits"),
        (paths.parse_receivers, "13.4.q, 14.1.K", [("head", 13, 4, "q"), ("head", 14, 1, "k")]),
        (_declare.positions, "2,-1", [2, -1]),
        (tracing.parse_scale, "auto", "auto"),
        (tracing.parse_scale, "2.5", 2.5),
        (_declare.count, "0", 0),
    ],
)
def test_option_parsers(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "match"),
    [
        (paths.parse_sender, "12", "LAYER.HEAD"),
        (paths.parse_sender, "head 3", "not a sender"),
        (paths.parse_receivers, "13.4", "LAYER.HEAD.q|k|v"),
        (paths.parse_receivers, "13.4.q,,", "not a receiver"),
        (_declare.positions, "2,x", "integers"),
        (_declare.positions, ",", "no positions"),
        (tracing.parse_scale, "nan", "positive"),
        (tracing.parse_scale, "loud", "neither"),
        (_declare.positive_int, "0", "≥ 1"),
        (_declare.count, "-2", "≥ 0"),
    ],
)
def test_malformed_option_values_are_one_line(parse, text, match):
    with pytest.raises(PipatchError, match=match) as caught:
        parse(text)
    assert "\n" not in str(caught.value)


def test_prompt_forms_read_cell_bodies():
    assert _declare.PROMPT.from_body(f"\n  {EIFFEL}  \n") == {"prompt": EIFFEL}
    assert _declare.PROMPT.from_body(f"prompt: {EIFFEL}\n\nprompt: {COLOSSEUM}") == {"prompt": [EIFFEL, COLOSSEUM]}
    assert _declare.PROMPT.from_body(f"prompt: {EIFFEL}") == {"prompt": EIFFEL}
    two = _declare.PAIR.from_body("clean: a\ncorrupt: b\n# note\nCLEAN: c\ncorrupt: d")
    assert two == {"clean": ["a", "c"], "corrupt": ["b", "d"]}
    with pytest.raises(PipatchError, match="2 clean, 1 corrupt"):
        _declare.PAIR.from_body("clean: a\ncorrupt: b\nclean: c")
    with pytest.raises(PipatchError, match="line 2"):
        _declare.PAIR.from_body("clean: a\nnoise: b")


def test_unknown_experiment_kind_lists_the_names():
    assert _registry.experiment("path-patch") is EXPERIMENTS["path_patch"]
    with pytest.raises(PipatchError, match="unknown experiment kind 'ablate': use trace, patch, attribute, path_patch, lens, circuit"):
        _registry.experiment("ablate")


def test_the_progress_bar_counts_rows_and_closes_after_the_last(capsys):
    """No model: rows as the engine reports them (:class:`pipatch._base.progress.StageBars`, the bar
    the CLI and the Python functions share); the engine never reports more than a stage holds."""
    from pipatch._base.progress import StageBars

    bars = StageBars("attribute")
    for done in [0, 1, 2, 3]:
        bars("run", done, 3)
        assert bars.current.n == done
    bars.close(finished=True)
    assert bars.current is None  # closed by the end of the run
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1 and " 3/3 rows" in err.rsplit("\r", 1)[-1]
    assert "4/3" not in err and "5/3" not in err
    quiet = StageBars("attribute", enabled=False)
    quiet("run", 1, 3)
    quiet.close(finished=True)
    assert capsys.readouterr().err == ""


def test_a_usage_error_names_the_command_once():
    out = subprocess.run([sys.executable, "-m", "pipatch.cli", "patch", "--site"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr == ("pipatch patch: error: argument --site: expected one argument "
                          "(see pipatch patch --help)\n")


@pytest.mark.parametrize(("argv", "match"), [
    (["--tensor-parallel-size", "2"], "splits a vLLM engine: add --backend vllm"),
    (["--tensor-parallel-size", "2", "--serve", "http://127.0.0.1:9"], "start the server with pipatch serve"),
    (["--backend", "vllm", "--tensor-parallel-size", "two"], "--tensor-parallel-size must be a whole number ≥ 1"),
])
def test_tensor_parallel_size_is_checked_before_any_model_loads(argv, match, capsys):
    """A vLLM-only flag: refused in one line on another backend, before any model loads."""
    assert cli.main(["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and err.startswith("pipatch trace: error: ")


def test_a_study_of_a_missing_facts_file_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """README's ``pipatch study known_1000.json ...`` in a folder without that file: one line at
    once, naming the copy pipatch ships (the unit layer fails a test that loads a model)."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["study", "known_1000.json", "--store", "known.sqlite", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipatch study: error: no facts file at 'known_1000.json'") and err.count("\n") == 1
    assert "ships with pipatch" in err and not (tmp_path / "known.sqlite").exists()
