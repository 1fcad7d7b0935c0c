"""The pipatch command and the registry it is built from: every experiment end to end, the
Python API's numbers in ``--json``, datasets, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipatch import cli
from tests._experiments import EMBEDDED, assert_json_matches, python_result
from tests.conftest import COLOSSEUM, EIFFEL

# --------------------------------------------------------------------------------------------
# Every command on the embedded model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EMBEDDED))
def test_every_command_writes_the_python_api_result(model, name, tmp_path, capsys):
    case = EMBEDDED[name]
    path, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    code = cli.main([*case["argv"], "--json", str(path), "--png", str(png)])
    assert code == 0
    captured = capsys.readouterr()
    want = python_result(model, name, case["kwargs"])
    assert f"wrote {path}" in captured.out
    for view in want.views:
        assert want.text(view) in captured.out  # the text heatmap
    # A circuit's grid is complete when planned; its bars count its stages' rows: a gradient pass
    # (one pair), the exact edge patches, then the curve's runs.
    # A feature circuit's: its exact node and edge checks, then the curve's runs.
    totals = ([1, len(want.meta["checked"]), None] if name == "circuit"
              else [want.meta["verify"] + want.meta["verify_edges"], None] if name == "feature_circuit"
              else [len(want.layers) * len(want.views)])
    # The progress bar (tqdm redraws it after "\r"): one line per stage as a terminal shows it,
    # ending at the total, once (an attribution's verification rows are its checks' stage).
    bars = [line.rsplit("\r", 1)[-1] for line in captured.err.split("\n") if " rows" in line]
    assert len(bars) == len(totals), captured.err
    for bar, total in zip(bars, totals):
        total = total or int(bar.rsplit("/", 1)[-1].split()[0])  # the curve's: as many as it ran
        assert f" {total}/{total} rows" in bar, captured.err
        assert f"{total + 1}/{total}" not in captured.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(path.read_text())
    assert_json_matches(data, want)
    if name == "attribute":
        assert data["meta"]["verified"] == want.meta["verified"]  # the verified cells, checked by real patches


def test_patch_command_with_heads_and_a_saved_result(model, tmp_path, capsys):
    code = cli.main(["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome",
                     "--site", "head", "--json", str(tmp_path / "p.json"), "--save", str(tmp_path / "p.safetensors"),
                     "--quiet"])
    assert code == 0
    assert "rows" not in capsys.readouterr().err  # --quiet: no progress bar
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["columns"] == ["H0", "H1", "H2", "H3"] and data["metric"] == "logit_diff"
    import pipatch

    assert pipatch.load_result(tmp_path / "p.safetensors").columns == data["columns"]


def test_a_dataset_of_pairs_on_the_command_line(model, tmp_path):
    """Repeated --clean / --corrupt (and --answer / --foil) pair up in order (attribution: cheap)."""
    path = tmp_path / "pairs.json"
    code = cli.main(["attribute", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--clean", COLOSSEUM, "--corrupt", EIFFEL,
                     "--answer", " Paris", "--answer", " Rome", "--foil", " Rome", "--foil", " Paris",
                     "--site", "head", "--json", str(path), "--quiet"])
    assert code == 0
    want = python_result(model, "attribute", {"clean": [EIFFEL, COLOSSEUM], "corrupt": [COLOSSEUM, EIFFEL],
                                              "answer": [" Paris", " Rome"], "foil": [" Rome", " Paris"],
                                              "site": "head"})
    assert want.n_seeds == 2  # one row of the seed axis per pair
    assert_json_matches(json.loads(path.read_text()), want)


def test_the_module_runs_as_a_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pipatch.cli", "patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris",
         "--foil", " Rome", "--positions", "-1", "--json", str(tmp_path / "p.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "18/18 rows" in out.stderr
    assert json.loads((tmp_path / "p.json").read_text())["kind"] == "patch"


# --------------------------------------------------------------------------------------------
# Bad input: one line naming the command, exit status 2
# --------------------------------------------------------------------------------------------

PAIR = ["--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        # refused by the parser (SystemExit 2), before any model is loaded
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--seeds", "0"], "≥ 1"),
        (["patch", "--site"], "expected one argument"),
        (["patch", *PAIR, "--sender", "12.2"], "unrecognized arguments: --sender"),
        (["path-patch", *PAIR, "--sender", "12"], "LAYER.HEAD"),
        (["path-patch", *PAIR, "--receivers", "13.4.z"], "not a receiver"),
        (["attribute", *PAIR, "--verify", "many"], "must be a whole number ≥ 0"),
        (["attribute", "--clean", EIFFEL, "--answer", " Paris"], "required: --corrupt"),
        # refused by the command before the model loads
        (["patch", *PAIR, "--clean", EIFFEL], "2 clean, 1 corrupt"),
        (["trace", EIFFEL, COLOSSEUM, "--subject", "a", "--subject", "b", "--subject", "c", "--answer", " Paris"],
         "--subject is given 3 times for 2 prompt"),
        # refused by the planner
        (["trace", "", "--subject", "x", "--answer", " Paris"], "empty"),
        (["trace", EIFFEL, "--subject", "Big Ben", "--answer", " Paris"], "not in the prompt"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", ""], "answer is empty"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--kind", "ffn"], "unknown site"),
        (["patch", "--clean", EIFFEL, "--corrupt", "Rome is", "--answer", " Paris", "--foil", " Rome"], "same length"),
        (["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--site", "neuron"], "unknown site"),
        (["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--metric", "kl"], "unknown metric"),
        (["patch", *PAIR, "--positions", "2,40"], "out of range"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--model", "org/not-here"],
         "cannot load model"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--device", "gpu"], "unknown device"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_command(model, capsys, argv, match):
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in err, err
    command = f"pipatch {argv[0]}"
    assert lines[0].startswith(f"{command}: error: ") and "pipatch pipatch" not in lines[0], lines[0]
    assert lines[0].count(command) <= 2  # the prefix, and at most "(see pipatch patch --help)"
