"""Results: derived grids, files (safetensors + JSON header, never pickle), exports."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

import pipatch
from pipatch._results.result import MIME_TYPE


def test_save_and_load_round_trip(tmp_path, eiffel_trace):
    path = eiffel_trace.save(tmp_path / "eiffel.safetensors")
    back = pipatch.load_result(path)
    assert back.views == eiffel_trace.views and back.tokens == eiffel_trace.tokens
    assert torch.equal(back.raw["resid"], eiffel_trace.raw["resid"])
    # The same stored raw metric and baselines through the same arithmetic: equal but for float
    # rounding, inside allclose's default 1e-5 relative.
    assert torch.allclose(back.grid, eiffel_trace.grid, equal_nan=True)
    assert back.meta["scale"] == eiffel_trace.meta["scale"]
    assert back.meta["versions"]["nnsight"] == eiffel_trace.meta["versions"]["nnsight"]


def test_damaged_files_are_refused_whole(tmp_path, eiffel_trace):
    good = eiffel_trace.save(tmp_path / "good.safetensors").read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good[: len(good) // 2])
    pickled = tmp_path / "pickled.safetensors"
    pickled.write_bytes(pickle.dumps({"grid": [1, 2, 3]}))
    for path in (truncated, pickled):
        with pytest.raises(pipatch.PipatchError, match="not a readable pipatch result"):
            pipatch.load_result(path)
    # A newer schema and inconsistent shapes, written as otherwise valid safetensors.
    from safetensors.torch import save_file

    header = json.loads(_header(good))
    for change, match in ((dict(schema=99), "schema 99"), (dict(layers=["0"]), "inconsistent")):
        bad = dict(header, **change)
        path = tmp_path / "bad.safetensors"
        save_file({"raw/resid": eiffel_trace.raw["resid"], "corrupt": eiffel_trace.corrupt_seeds},
                  str(path), metadata={"pipatch": json.dumps(bad)})
        with pytest.raises(pipatch.PipatchError, match=match):
            pipatch.load_result(path)


def _header(data: bytes) -> str:
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + size])["__metadata__"]["pipatch"]


def test_exports(eiffel_trace, tmp_path):
    df = eiffel_trace.frame()
    assert list(df.columns) == ["view", "layer", "column", "label", "recovery", "std", "raw"]
    assert len(df) == 18 * 9
    data = eiffel_trace.to_json()
    for key in ("kind", "model", "tokens", "layers", "grid", "metric", "clean", "corrupt"):
        assert key in data
    assert len(data["grid"]) == 18 and len(data["grid"][0]) == 9
    fig = eiffel_trace.plot()
    assert len(fig.axes) == 2  # heatmap + colour bar
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert " Eiffel" in labels
    bundle = eiffel_trace._repr_mimebundle_()
    assert set(bundle) == {MIME_TYPE, "image/png", "text/plain"}
    assert bundle[MIME_TYPE]["arrays"]["resid/mean"]["shape"] == [18, 9]


def test_widget_state_uses_binary_float32_buffers(eiffel_trace):
    state = eiffel_trace.to_state()
    spec = state["arrays"]["resid/seeds"]
    assert isinstance(spec["data"], bytes) and spec["dtype"] == "float32" and spec["shape"] == [10, 18, 9]
    assert len(spec["data"]) == 10 * 18 * 9 * 4
