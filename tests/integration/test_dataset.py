"""Averages over many prompts, aligned by named positions, on the real embedded model."""

from __future__ import annotations

import math

import pytest
import torch

import pipatch
from pipatch._experiments.dataset import named_groups
from pipatch._results.views import mime_bundle
from tests.conftest import COLOSSEUM, EIFFEL
from tests.unit.test_named_groups import NAMES


def test_trace_over_prompts_of_different_lengths(model):
    prompts = [EIFFEL, "The Statue of Liberty is in the city of"]
    r = pipatch.trace(model, prompts, subject=["Eiffel Tower", "Statue of Liberty"], answer=[" Paris", " New"],
                      seeds=2, scale=3.0)
    assert r.columns == NAMES and r.per_seed.shape == (4, 18, 7)  # 2 prompts × 2 seeds
    singles = [pipatch.trace(model, p, subject=s, answer=a, seeds=2, scale=3.0)
               for p, s, a in ((EIFFEL, "Eiffel Tower", " Paris"),
                               ("The Statue of Liberty is in the city of", "Statue of Liberty", " New"))]
    # Each prompt's rows are normalized against its own baselines.
    for i, single in enumerate(singles):
        _, groups = named_groups(single.meta["subject_positions"], len(single.tokens))
        mine = r.recovery()[2 * i : 2 * i + 2]
        for k, positions in enumerate(groups):
            if positions:
                expected = single.recovery()[:, :, positions].mean(-1)
                assert torch.allclose(mine[:, :, k], expected, atol=1e-5)
            else:
                assert torch.isnan(mine[:, :, k]).all()
    # Eiffel has no middle subject token; Statue of Liberty does: the mean still has one there.
    assert not math.isnan(float(r.grid[0, 2]))
    assert r.std().shape == (18, 7) and float(r.std()[:, -1].max()) > 0
    assert r.meta["prompts"] == prompts and r.meta["rows_per_prompt"] == [2, 2]
    # Every view names the seed axis's entries by prompt (and seed), never "seed 3".
    state = r.to_state()
    assert state["seed_noun"] == "prompt × seed runs"
    assert state["seed_labels"] == [f"prompt {p} · seed {s}: {prompts[p]}" for p in (0, 1) for s in (0, 1)]
    assert "4 prompt × seed runs" in repr(r) and "4 prompt × seed runs" in mime_bundle(state)["text/plain"]


def test_patch_over_pairs(model, tmp_path):
    pairs_clean = [EIFFEL, "The Louvre is in the city of"]
    pairs_corrupt = [COLOSSEUM, "The Vatican is in the city of"]
    r = pipatch.patch(model, clean=pairs_clean, corrupt=pairs_corrupt, answer=[" Paris", " Paris"],
                      foil=[" Rome", " Rome"])
    assert r.columns[1] == "first changed" and r.n_seeds == 2
    state = r.to_state()
    assert state["seed_noun"] == "prompts" and state["seed_labels"] == [f"prompt 0: {EIFFEL}",
                                                                         "prompt 1: The Louvre is in the city of"]
    assert pipatch.trace(model, EIFFEL, subject="Eiffel Tower", answer=" Paris", seeds=2,
                         scale=3.0).to_state()["seed_labels"] == []
    # The last layer's clean state is each pair's clean run: its logit difference within the
    # metric's 1e-4 (tests/integration/test_patching.py), the baselines shared: recovery 1 within
    # 1e-4 / |clean − corrupt|, averaged over the pairs (tests/_tolerance.py).
    from tests._tolerance import recovery_tolerance

    assert r.grid[-1, -1] == pytest.approx(1.0, abs=float(recovery_tolerance(r, 1e-4, baselines_shared=True)[-1, -1]))
    back = pipatch.load_result(r.save(tmp_path / "pairs.safetensors"))
    assert torch.allclose(back.grid, r.grid, equal_nan=True)  # the same stored numbers and arithmetic: rounding
    assert torch.equal(back.clean_seeds, r.clean_seeds)


def test_mismatched_lists_are_one_clear_line(model):
    with pytest.raises(pipatch.PipatchError, match="2 answers for 3 prompts"):
        pipatch.trace(model, [EIFFEL] * 3, subject="Eiffel Tower", answer=[" Paris", " Paris"], seeds=1)
    with pytest.raises(pipatch.PipatchError, match="same length"):
        pipatch.patch(model, clean=[EIFFEL], corrupt=[COLOSSEUM, COLOSSEUM], answer=" Paris", foil=" Rome")


def test_a_positions_subset_is_grouped_by_the_positions_it_swept(model):
    """With ``positions=``, each prompt's result holds only the swept columns: named groups
    average those, and a group none of them falls in is NaN (this used to raise IndexError)."""
    louvre, vatican = "The Louvre is in the city of", "The Vatican is in the city of"
    pair = dict(answer=" Paris", foil=" Rome", positions=[0, -1])
    r = pipatch.patch(model, clean=[EIFFEL, louvre], corrupt=[COLOSSEUM, vatican], **pair)
    assert r.status == "done" and r.columns[-1] == "last"
    for row, (clean, corrupt) in enumerate([(EIFFEL, COLOSSEUM), (louvre, vatican)]):
        one = pipatch.patch(model, clean=clean, corrupt=corrupt, **pair)
        assert torch.allclose(r.raw["resid"][row, :, 0], one.raw["resid"][0, :, 0], atol=1e-5)  # before = <bos>
        assert torch.allclose(r.raw["resid"][row, :, -1], one.raw["resid"][0, :, -1], atol=1e-5)  # last
    assert torch.isnan(r.raw["resid"][:, :, 1:-1]).all()  # the changed span was not swept
    top = pipatch._experiments._api.plan_patch(model, clean=[EIFFEL, louvre], corrupt=[COLOSSEUM, vatican],
                                  **pair).predictor()("resid", 17, 6, 1, 3)
    assert top[0][0] == " Paris"
