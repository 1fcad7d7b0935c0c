"""Faults, tried for real: interrupts, failing batches, out of memory, NaN, unsafe folders.

Faults are injected with ordinary PyTorch hooks on the real model (a layer that raises or
returns NaN); the model, nnsight and pipatch's engine all run for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pipatch


def test_remote_code_is_never_run(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(
        '{"model_type": "evil", "architectures": ["EvilForCausalLM"],'
        ' "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",'
        ' "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}')
    code = f"open({str(marker)!r}, 'w').write('executed')\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "modeling_evil.py").write_text(code)
    with pytest.raises(pipatch.PipatchError, match="cannot load model"):
        pipatch.load_model(str(folder))
    assert not marker.exists()


def test_no_pickle_or_remote_code_switch_in_pipatch():
    """Results never go through pickle. The two ``torch.load`` calls in pipatch, both with
    ``weights_only=True``: the served backend's reading of nnsight's serve answer (a
    ``torch.save``), and ``pipatch serve``'s reading of a program request (data only)."""
    sources = {p.relative_to(Path(pipatch.__file__).parent).as_posix(): p.read_text()
               for p in Path(pipatch.__file__).parent.rglob("*.py")}
    for needle in ("import pickle", "torch.load(", "allow_pickle=True", "weights_only=False",
                   "trust_remote_code=True", "trust_remote_code = True"):
        found = sorted(name for name, text in sources.items() if needle in text)
        loads = ["_backends/_served_programs.py", "_backends/served.py"]
        assert found == (loads if needle == "torch.load(" else []), (needle, found)
    for name in loads:
        assert sources[name].count("torch.load(") == 1
        assert "weights_only=True)" in sources[name]
