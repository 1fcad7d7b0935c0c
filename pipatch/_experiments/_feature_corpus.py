"""Finding each latent's top contexts over a corpus: :func:`feature_contexts` (the files it
writes and how they are read back: :mod:`._feature_contexts`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._base.checks import whole_number
from .._base.errors import PipatchError
from .._model.features.site import LatentSite
from ._api import backend_of
from ._feature_contexts import Contexts, read_latents, shown_tokens, window
from ._inputs import encode

__all__ = ["feature_contexts"]


def feature_contexts(model: Any, sae: LatentSite, texts: Sequence[str], *, k: int = 10,
                     folder: str | Path | None = None) -> Contexts:
    """Each latent's top-activating contexts over a corpus, stored next to the SAE.

    Parameters
    ----------
    model
        The model the SAE reads (:func:`pipatch.load_model`, or what it takes).
    sae
        Its latent site (:func:`pipatch.load_sae` with the model).
    texts
        The corpus: a list of strings, each run once (one forward each).
    k
        Contexts kept per latent.
    folder
        Where to store them; default the SAE's own folder (an SAE read from a folder).

    Returns
    -------
    Contexts
        ``contexts.top(latent)``: that latent's windows and activations, largest first. The
        files (:data:`TENSORS_FILE`, :data:`TEXT_FILE`) are written to ``folder``.

    Raises
    ------
    PipatchError
        One line: ``sae`` is not a latent site, ``texts`` is not a non-empty list of strings
        (or holds an empty one), ``k`` is not a whole number ≥ 1, or there is no folder to
        store them in (an SAE not read from a folder, and no ``folder=``).

    Examples
    --------
    >>> site = pipatch.load_sae("saes/L6", model)
    >>> contexts = pipatch.feature_contexts(model, site, corpus, k=5)
    >>> contexts.top(123)[0]
    ('… the Eiffel Tower is in the city of«Paris»', 7.25)
    """
    if not isinstance(sae, LatentSite):
        raise PipatchError(f"feature_contexts needs a latent site, got {type(sae).__name__}: pass "
                           "pipatch.load_sae(source, model)")
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise PipatchError("texts must be a non-empty list of strings (the corpus), e.g. ['The Eiffel Tower is ...', ...]")
    k = whole_number(k, "k (contexts per latent)", 1)
    where = folder if folder is not None else sae.sae.folder
    if where is None:
        raise PipatchError(f"SAE {sae.name!r} was not read from a folder, so its contexts have nowhere to go: pass "
                           "folder= (a folder to keep them in)")
    backend = backend_of(model)
    special = set(getattr(backend.tokenizer, "all_special_ids", []) or [])
    best = torch.zeros(sae.n_latents, 0)
    where_from = torch.zeros(sae.n_latents, 0, 2, dtype=torch.long)  # (text, position) of each
    tokens_of: list[list[str]] = []
    for number, text in enumerate(texts):
        input_ids, tokens, _ = encode(backend, text, f"text {number}")
        keep = torch.tensor([int(i) not in special for i in input_ids[0].tolist()])
        tokens_of.append(shown_tokens(tokens, keep.tolist()))
        latents = read_latents(backend, input_ids, [sae])[0][sae.name]  # [T, d_sae]
        latents = torch.where(keep[:, None], latents, torch.zeros(()))
        here = torch.stack([torch.full((len(tokens),), number), torch.arange(len(tokens))], dim=1)
        values = torch.cat([best, latents.T], dim=1)
        # Stable: of equal activations the earlier context stays first.
        order = values.argsort(dim=1, descending=True, stable=True)[:, :k]
        best = values.gather(1, order)
        where_from = torch.cat([where_from, here[None].expand(sae.n_latents, -1, -1)], dim=1)
        where_from = where_from.gather(1, order[..., None].expand(-1, -1, 2))
    fired = best > 0  # [d_sae, m], m = min(k, tokens read)
    longest = max(len(tokens) for tokens in tokens_of)
    codes = where_from[..., 0] * longest + where_from[..., 1]
    used, numbers = torch.unique(codes[fired], return_inverse=True)  # each context once, in corpus order
    m = best.shape[1]
    context = torch.full((sae.n_latents, k), -1, dtype=torch.long)
    activation = torch.zeros(sae.n_latents, k)
    context[:, :m][fired] = numbers
    activation[:, :m][fired] = best[fired]
    pairs = [(code // longest, code % longest) for code in used.tolist()]
    records = [window(tokens_of[t], p, t) for t, p in pairs]
    found = Contexts(sae.name, activation, context, records, str(backend.name))
    found.save(where)
    return found
