"""Top-activating contexts: where in a corpus each latent fires hardest.

A latent's label is a guess; its top contexts are the evidence. :func:`pipatch.feature_contexts` runs
every text of a corpus through the model once (the capture program's read, as
:func:`pipatch.features` does), encodes the SAE's value at every token, and keeps for each
latent the ``k`` (text, position) pairs where it is largest, with a window of the text around
each: ``"… the Eiffel Tower is in the city of" + "«Paris»"``. A position where the latent is
0 never counts, nor does a special token (the BOS token's activations are outliers, as
Neuronpedia also skips them), and a window shows no special token: ``<bos>`` is no text of the
corpus, so it is left out of the window (:func:`shown_tokens`).

They are stored next to the SAE, in its folder (safetensors + JSON, no pickle):

* :data:`TENSORS_FILE`: ``activation`` [d_sae, k] float32 (largest first; 0 where a latent has
  fewer than ``k`` contexts) and ``context`` [d_sae, k] int64, each entry's index into the
  JSON's contexts (−1: none);
* :data:`TEXT_FILE`: ``{"sae", "model", "k", "n_texts", "contexts": [{"text", "position",
  "before", "token", "after"}, ...]}``: which text and token each context is, and its window.

:func:`load_contexts` reads them back (:func:`pipatch.features` does so on its own). Contexts
are tokenizer and corpus text: kept as text, never read as HTML. :func:`pipatch.feature_contexts`
(:mod:`._feature_corpus`) finds them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._base.errors import PipatchError
from .._model.cells import Capture, Metric
from .._model.features.site import LatentSite
from .._programs.capture import capture

__all__ = ["Contexts", "load_contexts", "window", "shown_tokens", "read_latents", "NO_METRIC", "TENSORS_FILE", "TEXT_FILE"]

TENSORS_FILE = "contexts.safetensors"
TEXT_FILE = "contexts.json"

#: A capture reads a metric at the end of its run; reading latents needs none, so it reads the
#: cheapest one there is: one token's logit against itself (two rows of the unembedding).
NO_METRIC = Metric("logit_diff", (0,), (0,))

#: Tokens of a context's window before and after the token it is about.
BEFORE, AFTER = 12, 3


def read_latents(backend: Any, input_ids: torch.Tensor, sites: Sequence[LatentSite]) -> tuple[dict[str, torch.Tensor], Capture]:
    """One forward of ``input_ids`` ([1, T]) through the backend's capture program: each latent
    site's latents at its own layer, ``{site name: [T, d_sae]}`` float32 on the CPU, and the
    run's capture (the base run of clicks on a feature grid)."""
    run = capture(backend, input_ids, NO_METRIC, list(sites))
    return {site.name: run.sites[site.name][site.layer][0].float().cpu() for site in sites}, run


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
    """The contexts stored in ``folder`` (:func:`pipatch.feature_contexts`), or ``None`` where there
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


def shown_tokens(tokens: list[str], is_text: list[bool]) -> list[str]:
    """``tokens`` as a window shows them: a special token (``is_text`` false: BOS, EOS, padding)
    becomes the empty string, so its markup (``"<bos>"``) never reads as part of the text."""
    return [token if text else "" for token, text in zip(tokens, is_text)]


def window(tokens: list[str], position: int, text: int) -> dict[str, Any]:
    """The window of ``tokens`` around ``position`` of text number ``text``: up to
    :data:`BEFORE` tokens before it (``"…"`` first where more came before), the token, and up to
    :data:`AFTER` after it, as a :class:`Contexts` record (special tokens blanked by
    :func:`shown_tokens` first)."""
    before = "".join(tokens[max(0, position - BEFORE):position])
    return {"text": text, "position": position, "before": ("…" if position > BEFORE else "") + before,
            "token": tokens[position], "after": "".join(tokens[position + 1:position + 1 + AFTER])}
