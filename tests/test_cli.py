"""The pipatch command: the main job end to end, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipatch import cli
from tests.conftest import COLOSSEUM, EIFFEL


def test_trace_command_writes_json_and_png(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pipatch.cli", "trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris",
         "--seeds", "2", "--json", str(tmp_path / "t.json"), "--png", str(tmp_path / "t.png")],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "█" in out.stdout and "recovery" in out.stdout
    assert "18/18 rows" in out.stderr  # the progress bar
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["kind"] == "trace" and len(data["grid"]) == 18 and data["tokens"][2] == " Eiffel"
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_patch_command_in_process(model, capsys, tmp_path):
    code = cli.main(["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome",
                     "--site", "head", "--json", str(tmp_path / "p.json"), "--save", str(tmp_path / "p.safetensors"),
                     "--quiet"])
    assert code == 0
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["columns"] == ["H0", "H1", "H2", "H3"] and data["metric"] == "logit_diff"
    import pipatch

    assert pipatch.load_result(tmp_path / "p.safetensors").columns == data["columns"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["trace", "", "--subject", "x", "--answer", " Paris"], "empty"),
        (["trace", EIFFEL, "--subject", "Big Ben", "--answer", " Paris"], "not in the prompt"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris Texas"], "not one"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--seeds", "0"], "at least 1"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--kind", "ffn"], "unknown kind"),
        (["patch", "--clean", EIFFEL, "--corrupt", "Rome is", "--answer", " Paris", "--foil", " Rome"], "same length"),
        (["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--site", "neuron"], "unknown site"),
        (["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--metric", "kl"], "unknown metric"),
        (["patch", "--clean", EIFFEL, "--corrupt", COLOSSEUM, "--answer", " Paris", "--foil", " Rome",
          "--positions", "2,40"], "out of range"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--model", "org/not-here"],
         "cannot load model"),
        (["trace", EIFFEL, "--subject", "Eiffel Tower", "--answer", " Paris", "--device", "gpu"], "unknown device"),
    ],
)
def test_bad_input_exits_2_with_one_line(model, capsys, argv, match):
    with pytest.raises(SystemExit) if "--seeds" in argv else _no_raise():
        code = cli.main(argv)
        assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and match in lines[0] and "Traceback" not in err


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
