"""Figures that compare (#45): one colour scale per kind of value (sequential for the lens's
probability and rank, rank 0 the darkest), the subject's tokens and the verified cells marked,
plots made together on one scale, a circuit's title for a dataset and its faithful edge count.
The browser's side of the same definitions: js/__tests__/parity.test.ts and grid.test.ts."""

from __future__ import annotations

import base64
import io

import matplotlib.image
import numpy as np
import pytest
import torch

import pipatch
from pipatch._results.result import Result
from pipatch._results.views import MIME_TYPE, figure, mime_document, png
from pipatch._results.views.colors import DIVERGING, RANK, SEQUENTIAL, SEQUENTIAL_STOPS, scale_kind, scale_rgb, strength
from pipatch._results.views.render import SUBJECT_RGB, color_scale

torch.set_num_threads(1)

RANKS = [[5000.0, 40.0, 3.0, 700.0], [12.0, 0.0, 1.0, 250.0], [0.0, 2.0, 9.0, 0.0]]


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


def _lens(metric: str = "rank", values=RANKS, **meta) -> Result:
    raw = torch.tensor([values], dtype=torch.float32)
    tokens = ["The", " <b>Eiffel", " Tower", " is"]
    return Result(kind="lens", tokens=tokens, columns=tokens, layers=[str(i) for i in range(len(values))],
                  metric=metric, raw={"resid": raw}, clean=float(raw[0, -1, -1]), corrupt=torch.tensor([float("nan")]),
                  meta={"model": "m", "normalize": False, **meta}, rows_done={"resid": len(values)})


def _trace(scale: float = 1.0, **meta) -> Result:
    """Recovery ``scale`` × (+1 at (0, 1), −1 at (2, 3), 0.5 at (1, 2)), four tokens."""
    raw = torch.zeros(2, 3, 4)
    raw[:, 0, 1], raw[:, 2, 3], raw[:, 1, 2] = scale, -scale, 0.5 * scale
    tokens = ["The", " Eiffel", " Tower", " is"]
    return Result(kind="trace", tokens=tokens, columns=tokens, layers=["0", "1", "2"], metric="prob",
                  raw={"resid": raw}, clean=1.0, corrupt=torch.zeros(2), meta={"model": "m", **meta},
                  rows_done={"resid": 3})


def _cells(ax, n_rows: int, n_cols: int, image: np.ndarray | None = None) -> np.ndarray:
    """The 0–255 RGB at the centre of every cell of the heatmap ``ax`` (row 0 at the top), read
    from ``image`` (a rendering of its figure; ``None``: the figure drawn now)."""
    if image is None:
        ax.figure.canvas.draw()
        image = np.asarray(ax.figure.canvas.buffer_rgba())
    if image.dtype.kind == "f":
        image = np.round(image * 255)
    box = ax.get_window_extent()
    out = np.zeros((n_rows, n_cols, 3), dtype=int)
    for r in range(n_rows):
        for c in range(n_cols):
            x = box.x0 + (c + 0.5) / n_cols * box.width
            y = image.shape[0] - (box.y1 - (r + 0.5) / n_rows * box.height)
            out[r, c] = image[int(y), int(x), :3]
    return out


def _panels(fig) -> list:
    return [ax for ax in fig.axes if ax.images]


# --------------------------------------------------------------------------- scales


def test_the_lens_rank_map_puts_rank_0_at_the_strongest_colour():
    r = _lens("rank")
    state = r.to_state()
    assert scale_kind(state) == RANK and color_scale(state) == (RANK, 0.0, 5000.0)
    darkest, palest = _rgb(SEQUENTIAL_STOPS[-1]), _rgb(SEQUENTIAL_STOPS[0])
    assert scale_rgb(0.0, RANK, 0.0, 5000.0) == darkest and scale_rgb(5000.0, RANK, 0.0, 5000.0) == palest
    # The figure and the PNG: rank 0's cells in the darkest colour, the worst rank in the palest,
    # and a better rank never paler than a worse one.
    fig = figure(state, dpi=80)
    drawn = _cells(fig.axes[0], 3, 4)
    ranks = np.array(RANKS)
    for r_, c in zip(*np.nonzero(ranks == 0)):
        assert np.abs(drawn[r_, c] - darkest).max() <= 3
    assert np.abs(drawn[0, 0] - palest).max() <= 3
    order = np.argsort(ranks.ravel(), kind="stable")
    brightness = drawn.reshape(-1, 3).sum(1)[order]
    assert all(brightness[i] <= brightness[i + 1] + 3 for i in range(len(order) - 1))
    picture = matplotlib.image.imread(io.BytesIO(png(state, dpi=80)))
    assert np.array_equal(_cells(fig.axes[0], 3, 4, picture), drawn)
    # The text grid shades by the same scale: rank 0 is █, the worst rank blank; the best ranks first.
    lines = r.text().splitlines()
    grid = [line[5:].split() for line in lines[2:5]]
    assert grid[1][1] == grid[2][0] == grid[2][3] == "█"
    assert lines[2][5:].rstrip().startswith(" " * 7) and "█" not in lines[2][5:12]
    assert lines[5].endswith("rank 0.000")


def test_a_probability_drawn_as_itself_is_sequential_and_a_recovery_diverging():
    prob = _lens("prob", [[0.0, 0.2, 0.5, 0.1], [0.9, 0.3, 0.6, 0.05]])
    assert color_scale(prob.to_state()) == (SEQUENTIAL, 0.0, pytest.approx(0.9))
    assert scale_rgb(0.0, SEQUENTIAL, 0.0, 0.9) == _rgb(SEQUENTIAL_STOPS[0])
    assert scale_rgb(0.9, SEQUENTIAL, 0.0, 0.9) == _rgb(SEQUENTIAL_STOPS[-1])
    assert strength(float("nan"), SEQUENTIAL, 0.0, 1.0) != strength(float("nan"), SEQUENTIAL, 0.0, 1.0)  # NaN
    trace = _trace()
    assert scale_kind(trace.to_state()) == DIVERGING  # normalized recovery: signed
    assert scale_kind(trace.to_state(), "raw") == SEQUENTIAL  # the raw probability: no sign to show
    assert color_scale(_lens("logprob", [[-3.0, -0.5], [-1.0, 0.0]]).to_state()) == (SEQUENTIAL, -3.0, 0.0)


# --------------------------------------------------------------------------- plots made together


def _norms(fig) -> list[tuple[float, float]]:
    return [(float(ax.images[0].norm.vmin), float(ax.images[0].norm.vmax)) for ax in _panels(fig)]


def test_two_plots_made_together_share_a_colour_scale():
    small, large = _trace(1.0), _trace(3.0)
    assert _norms(figure(small.to_state())) == [(-1.0, 1.0)]  # each plot alone: its own maximum
    fig = pipatch.plot([small, large], pyplot=False)
    assert _norms(fig) == [(-3.0, 3.0), (-3.0, 3.0)]
    # One colour is one number in both panels: the small plot's +1 is drawn as 1 on the shared
    # scale (not as its own maximum), paler than the large plot's +3.
    fig.canvas.draw()
    small_cells, large_cells = (_cells(ax, 3, 4) for ax in _panels(fig))
    assert np.abs(small_cells[0, 1] - scale_rgb(1.0, DIVERGING, -3.0, 3.0)).max() <= 3
    assert np.abs(large_cells[0, 1] - scale_rgb(3.0, DIVERGING, -3.0, 3.0)).max() <= 3
    assert np.abs(small_cells[0, 1] - large_cells[0, 1]).max() > 30
    assert _norms(pipatch.plot([small, large], scale="auto", pyplot=False)) == [(-1.0, 1.0), (-3.0, 3.0)]
    assert _norms(pipatch.plot([small, large], scale=(-2, 2), pyplot=False)) == [(-2.0, 2.0), (-2.0, 2.0)]
    with pytest.raises(pipatch.PipatchError, match="different kinds of values"):
        pipatch.plot([small, _lens("prob", [[0.1, 0.2, 0.3, 0.4]])], pyplot=False)
    with pytest.raises(pipatch.PipatchError, match="vmin < vmax"):
        pipatch.plot([small], scale=(1, 1), pyplot=False)
    with pytest.raises(pipatch.PipatchError, match="not a colour range"):
        small.plot(scale="wide")
    with pytest.raises(pipatch.PipatchError, match=r"pipatch.plot\(\[a, b\], scale='shared'\)"):
        small.plot(scale="shared")


def test_result_plot_takes_a_colour_range():
    import matplotlib.pyplot as plt

    plotted = _trace(1.0).plot(scale=(-4, 4))
    assert _norms(plotted) == [(-4.0, 4.0)]
    plt.close(plotted)


# --------------------------------------------------------------------------- marks


def test_a_trace_marks_its_subject_tokens_in_the_figure_and_the_mime_output():
    r = _trace(subject_positions=[1, 2])
    state = r.to_state()
    assert state["subject"] == [1, 2]
    assert mime_document(state)["subject"] == [1, 2]
    bundle = r._repr_mimebundle_()
    assert bundle[MIME_TYPE]["subject"] == [1, 2]
    fig = figure(state)
    ax = fig.axes[0]
    ticks = ax.get_xticklabels()
    assert [t.get_fontweight() for t in ticks] == ["normal", "bold", "bold", "normal"]
    assert [t.get_color() for t in ticks][1:3] == [SUBJECT_RGB, SUBJECT_RGB]
    marks = [c for c in ax.collections if c.get_gid() == "subject"]
    assert len(marks) == 1 and marks[0].get_offsets()[:, 0].tolist() == [1, 2]
    assert "▲ subject" in ax.get_xlabel()
    # The bundle's PNG is that figure; a trace without a subject has no marks.
    assert base64.b64decode(bundle["image/png"]) == png(state)
    plain = figure(_trace().to_state()).axes[0]
    assert not [c for c in plain.collections if c.get_gid() == "subject"] and "subject" not in plain.get_xlabel()


def test_the_subject_is_marked_among_the_positions_swept_and_a_datasets_named_positions():
    swept = _trace(subject_positions=[2, 3], positions=[0, 2, 5, 7])
    assert swept.to_state()["subject"] == [1]  # position 2 is column 1; position 3 was not swept
    names = ["before", "first subject", "middle subject", "last subject", "first after", "further", "last"]
    raw = torch.zeros(2, 3, len(names))
    dataset = Result(kind="trace", tokens=names, columns=names, layers=["0", "1", "2"], metric="prob",
                     raw={"resid": raw}, clean=1.0, corrupt=torch.zeros(2),
                     meta={"model": "m", "dataset": True, "subject_positions": [4, 5]}, rows_done={"resid": 3})
    assert dataset.to_state()["subject"] == [1, 2, 3]
    assert _lens("rank", subject_positions=[1]).to_state()["subject"] == [1]


def test_attribution_marks_its_verified_cells():
    mask = [[0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 1]]
    r = _trace(verified={"resid": mask})
    fig = figure(r.to_state())
    ax = fig.axes[0]
    outlines = [c for c in ax.collections if c.get_gid() == "verified"]
    assert len(outlines) == 1
    centres = sorted((round(float(p.vertices[:4, 1].mean())), round(float(p.vertices[:4, 0].mean())))
                     for p in outlines[0].get_paths())
    assert centres == [(0, 1), (2, 0), (2, 3)]
    assert "checked by an exact patch" in ax.get_xlabel()
    assert not [c for c in figure(_trace().to_state()).axes[0].collections if c.get_gid() == "verified"]


# --------------------------------------------------------------------------- circuits


def test_a_circuits_title_names_a_datasets_answers_not_the_first_pairs():
    pairs = [{"clean": f"c{i}", "corrupt": f"x{i}", "answer": a, "foil": f}
             for i, (a, f) in enumerate([(" Mary", " John"), (" Anna", " Tom"), (" Mary", " John"),
                                         (" Bob", " Sue"), (" Eve", " Dan")])]
    meta = {"model": "m", "method": "eap-ig", "n_pairs": 5, "answer": " Mary", "foil": " John", "pairs": pairs}
    r = Result(kind="circuit", tokens=["a"], columns=["a"], layers=["0"], metric="logit_diff",
               raw={"edges": torch.zeros(1, 1, 1)}, clean=1.0, corrupt=torch.zeros(1), meta=meta)
    assert r.title == "Circuit (eap-ig, 5 pairs) · m · answers ' Mary', ' Anna', ' Bob' +1 more vs ' John', ' Tom', ' Sue' +1 more"
    one = Result(kind="circuit", tokens=["a"], columns=["a"], layers=["0"], metric="logit_diff",
                 raw={"edges": torch.zeros(1, 1, 1)}, clean=1.0, corrupt=torch.zeros(1),
                 meta={**meta, "n_pairs": 1, "pairs": pairs[:1]})
    assert one.title == "Circuit (eap-ig) · m · ' Mary' vs ' John'"


def test_a_circuits_figure_draws_as_many_edges_as_its_faithful_circuit():
    from matplotlib.patches import PathPatch

    from tests._contract import example_circuit

    r = example_circuit()
    total = len(r.edges())
    edges = lambda fig: [p for p in fig.axes[0].patches if isinstance(p, PathPatch)]  # noqa: E731
    assert len(edges(figure(r.to_state()))) == min(50, total)  # no size reaches the share: the default
    r.meta["faithfulness"] = {**r.meta["faithfulness"], "size": 10}
    fig = figure(r.to_state())
    assert len(edges(fig)) == 10
    assert f"top 10 of {total} edges by |score| (the faithful circuit)" in fig.axes[0].get_title()
    assert len(edges(figure(r.to_state(), top=4))) == 4
