"""Top-activating contexts: where in a corpus each latent fires hardest.

A latent's label is a guess; its top contexts are the evidence. :func:`feature_contexts` runs
every text of a corpus through the model once (the capture program's read, as
:func:`pipatch.features` does), encodes the SAE's value at every token, and keeps for each
latent the ``k`` (text, position) pairs where it is largest, with a window of the text around
each: ``"… the Eiffel Tower is in the city of" + "«Paris»"``. A position where the latent is
0 never counts, nor does a special token (the BOS token's activations are outliers, as
Neuronpedia also skips them).

They are stored next to the SAE, in its folder (safetensors + JSON, no pickle):

* :data:`TENSORS_FILE`: ``activation`` [d_sae, k] float32 (largest first; 0 where a latent has
  fewer than ``k`` contexts) and ``context`` [d_sae, k] int64, each entry's index into the
  JSON's contexts (−1: none);
* :data:`TEXT_FILE`: ``{"sae", "model", "k", "n_texts", "contexts": [{"text", "position",
  "before", "token", "after"}, ...]}``: which text and token each context is, and its window.

:func:`load_contexts` reads them back (:func:`pipatch.features` does so on its own). Contexts
are tokenizer and corpus text: kept as text, never read as HTML.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._cells import Metric
from .._errors import PipatchError
from .._programs.capture import capture
from .._protocols._inputs import encode
from ._site import LatentSite

__all__ = ["Contexts", "feature_contexts", "load_contexts", "read_latents", "TENSORS_FILE", "TEXT_FILE"]

TENSORS_FILE = "contexts.safetensors"
TEXT_FILE = "contexts.json"

#: A capture reads a metric at the end of its run; reading latents needs none, so it reads the
#: cheapest one there is: one token's logit against itself (two rows of the unembedding).
_NO_METRIC = Metric("logit_diff", (0,), (0,))

#: Tokens of a context's window before and after the token it is about.
BEFORE, AFTER = 12, 3


def read_latents(backend: Any, input_ids: torch.Tensor, sites: Sequence[LatentSite]) -> dict[str, torch.Tensor]:
    """One forward of ``input_ids`` ([1, T]) through the backend's capture program: each latent
    site's latents at its own layer, ``{site name: [T, d_sae]}`` float32 on the CPU."""
    run = capture(backend, input_ids, _NO_METRIC, list(sites))
    return {site.name: run.sites[site.name][site.layer][0].float().cpu() for site in sites}


@dataclass
class Contexts:
    """One SAE's top contexts (see the module docstring).

    Attributes
    ----------
    sae
        The SAE's name.
    activation
        [d_sae, k]: each latent's largest activations over the corpus, largest first (0: none).
    context
        [d_sae, k]: the index into ``contexts`` of each (−1: none).
    contexts
        Each context once: ``{"text": i, "position": p, "before": ..., "token": ..., "after": ...}``.
    model
        The model they were read on.
    """

    sae: str
    activation: torch.Tensor
    context: torch.Tensor
    contexts: list[dict[str, Any]]
    model: str = ""

    @property
    def k(self) -> int:
        return int(self.activation.shape[1])

    def top(self, latent: int) -> list[tuple[str, float]]:
        """Latent ``latent``'s contexts, largest activation first: ``(window, activation)``,
        the window's own token in guillemets (``"… the city of«Paris»"``)."""
        out = []
        for index, value in zip(self.context[latent].tolist(), self.activation[latent].tolist()):
            if index >= 0:
                record = self.contexts[index]
                out.append((f"{record['before']}«{record['token']}»{record['after']}", float(value)))
        return out

    def save(self, folder: str | Path) -> Path:
        """Write both files into ``folder`` (made if missing); returns the folder."""
        from safetensors.torch import save_file

        folder = Path(folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"activation": self.activation.float().contiguous(), "context": self.context.long().contiguous()},
                  str(folder / TENSORS_FILE))
        document = {"sae": self.sae, "model": self.model, "k": self.k, "contexts": self.contexts}
        (folder / TEXT_FILE).write_text(json.dumps(document, ensure_ascii=False), encoding="utf-8")
        return folder


def load_contexts(folder: str | Path | None) -> Contexts | None:
    """The contexts stored in ``folder`` (:func:`feature_contexts`), or ``None`` where there
    are none. A damaged pair of files is one :class:`PipatchError` line."""
    if folder is None:
        return None
    folder = Path(folder).expanduser()
    if not (folder / TENSORS_FILE).is_file() or not (folder / TEXT_FILE).is_file():
        return None
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / TENSORS_FILE))
        document = json.loads((folder / TEXT_FILE).read_text(encoding="utf-8"))
        activation, context, contexts = tensors["activation"], tensors["context"], list(document["contexts"])
        ok = activation.shape == context.shape and activation.ndim == 2 and int(context.max()) < len(contexts)
    except Exception as error:  # noqa: BLE001 - any parse failure means damaged files
        raise PipatchError(f"the contexts in {folder} cannot be read ({type(error).__name__}): run "
                           "pipatch.feature_contexts again to rewrite them") from None
    if not ok:
        raise PipatchError(f"the contexts in {folder} are inconsistent: run pipatch.feature_contexts again")
    return Contexts(str(document.get("sae", "")), activation, context, contexts, str(document.get("model", "")))


def _window(tokens: list[str], position: int, text: int) -> dict[str, Any]:
    before = "".join(tokens[max(0, position - BEFORE):position])
    return {"text": text, "position": position, "before": ("…" if position > BEFORE else "") + before,
            "token": tokens[position], "after": "".join(tokens[position + 1:position + 1 + AFTER])}


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
    from .._api import backend_of

    if not isinstance(sae, LatentSite):
        raise PipatchError(f"feature_contexts needs a latent site, got {type(sae).__name__}: pass "
                           "pipatch.load_sae(source, model)")
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise PipatchError("texts must be a non-empty list of strings (the corpus), e.g. ['The Eiffel Tower is ...', ...]")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise PipatchError(f"k must be a whole number ≥ 1 (contexts per latent), got {k!r}")
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
        tokens_of.append(tokens)
        latents = read_latents(backend, input_ids, [sae])[sae.name]  # [T, d_sae]
        keep = torch.tensor([int(i) not in special for i in input_ids[0].tolist()])
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
    records = [_window(tokens_of[t], p, t) for t, p in pairs]
    found = Contexts(sae.name, activation, context, records, str(backend.name))
    found.save(where)
    return found
