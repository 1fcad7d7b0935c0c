"""The pure parts of feature patching (:mod:`pipatch._experiments._feature_screen`): the chain rule
through an SAE's decoder, the choice of cells to patch, and the check of latent ids. No model."""

from __future__ import annotations

import pytest
import torch

from pipatch import PipatchError
from pipatch._experiments._feature_screen import cell_scores, check_latents, latent_gradient, rows_of, top_cells
from pipatch._model.features.hooks import Hook
from pipatch._model.features.sae import SAE
from pipatch._model.features.site import latent_site


def toy_site():
    """A real latent site of a random 6-wide SAE with 5 latents at a block's output (no model:
    the hooks are written out)."""
    g = torch.Generator().manual_seed(0)
    sae = SAE(activation="relu", W_enc=torch.randn(6, 5, generator=g), b_enc=torch.zeros(5),
              W_dec=torch.randn(5, 6, generator=g), b_dec=torch.randn(6, generator=g), hook="blocks.0.hook_resid_post")
    hook = Hook(0, "resid_post", "", False)
    return latent_site(sae, hook, hook, "L0 resid_post")


def test_the_latent_gradient_is_the_holder_gradient_through_w_dec():
    site = toy_site()
    latents, grad = torch.rand(1, 3, 5), torch.randn(1, 3, 6)
    through = grad @ site.sae.W_dec.T
    assert torch.allclose(latent_gradient(site, latents, grad), through, atol=1e-6)
    scores = cell_scores(site, latents + 1, latents, grad)
    assert scores.shape == (3, 5) and torch.allclose(scores, through[0], atol=1e-6)
    # The error node decodes by the identity: its gradient is the holder's.
    errors = torch.randn(1, 3, 6)
    assert torch.equal(latent_gradient(site.error_site, errors, grad), grad)
    assert site.error_site.name == "L0 resid_post error" and site.error_site.place_key == site.place_key


def test_top_cells_are_the_largest_magnitudes_first_and_rows_keep_their_order():
    scores = torch.tensor([[0.1, -3.0], [2.0, 0.0], [-2.0, 5.0]])
    assert top_cells(scores, 3) == [(2, 1), (0, 1), (1, 0)]  # |2| ties: row-major order
    assert len(top_cells(scores, 99)) == 6
    assert rows_of([(2, 1), (0, 1), (2, 0), (1, 0)]) == [2, 0, 1]


@pytest.mark.parametrize(("latents", "says"), [
    ([0, 9], "latent 9 is not a latent of L3: pass ids from 0 to 8"),
    ([-1], "latent -1 is not"),
    (["3"], "latent '3' is not"),
    ([True], "latent True is not"),
    ([], "latents is empty"),
    ([4, 1, 4], "latent 4 is given twice"),
])
def test_bad_latent_ids_are_one_line(latents, says):
    with pytest.raises(PipatchError, match=says) as error:
        check_latents(latents, 9, "L3")
    assert "\n" not in str(error.value)


def test_good_latent_ids_pass_as_a_list():
    assert check_latents((3, 0, 8), 9, "L3") == [3, 0, 8]
    assert check_latents(5, 9, "L3") == [5]
