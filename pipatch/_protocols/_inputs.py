"""Checking and tokenizing what a researcher passes in; every problem is one clear line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._models import PipatchError, adapter_for, dispatched

SITES = ("resid", "attn", "mlp", "head")


def device_of(model) -> torch.device:
    hf = getattr(dispatched(model), "_module", model)
    try:
        return next(hf.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def encode(model, text: str, what: str = "prompt") -> tuple[torch.Tensor, list[str], list[tuple[int, int]]]:
    """Tokenize ``text`` → (ids [1, T], token strings, character offsets)."""
    if not isinstance(text, str) or not text.strip():
        raise PipatchError(f"the {what} is empty: pass the text to run, e.g. 'The Eiffel Tower is in the city of'")
    tok = model.tokenizer
    try:
        enc = tok(text, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):
        enc = tok(text)
        offsets = []
    ids = list(enc["input_ids"])
    limit = _context_length(model)
    if limit and len(ids) > limit:
        raise PipatchError(
            f"the {what} is {len(ids)} tokens, longer than the model's context of {limit}: shorten it"
        )
    tokens = [tok.decode([i]) for i in ids]
    return torch.tensor([ids], device=device_of(model)), tokens, offsets


def _context_length(model) -> int | None:
    config = getattr(model, "config", None) or getattr(getattr(model, "_module", None), "config", None)
    config = getattr(config, "text_config", None) or config
    for name in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def single_token(model, text: str, role: str) -> int:
    """The id of ``text`` when it is exactly one token; otherwise an error showing the split."""
    if not isinstance(text, str) or text == "":
        raise PipatchError(f"the {role} is empty: pass one token, e.g. ' Paris' (mind the leading space)")
    tok = model.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = [tok.decode([i]) for i in ids]
        raise PipatchError(
            f"the {role} {text!r} is {len(ids)} tokens {pieces}, not one: pick a single-token "
            f"{role} (often with a leading space, e.g. ' Paris')"
        )
    return int(ids[0])


def subject_positions(subject: str | Sequence[int], prompt: str, tokens: list[str],
                      offsets: list[tuple[int, int]]) -> list[int]:
    """Token positions of the subject: every token overlapping its text, or explicit indices."""
    T = len(tokens)
    if isinstance(subject, str):
        if not subject.strip():
            raise PipatchError("the subject is empty: pass the subject's text as it appears in the prompt")
        start = prompt.find(subject)
        if start < 0:
            raise PipatchError(f"subject {subject!r} is not in the prompt {prompt!r}: pass text that appears in it verbatim")
        end = start + len(subject)
        if not offsets:
            raise PipatchError("this tokenizer gives no character offsets: pass the subject as token indices")
        found = [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
        if not found:
            raise PipatchError(f"subject {subject!r} covers no token of the prompt: pass token indices instead")
        return found
    try:
        positions = [int(i) for i in subject]
    except (TypeError, ValueError):
        raise PipatchError("subject must be text or a list of token indices") from None
    if not positions:
        raise PipatchError("the subject's token list is empty: pass at least one index")
    return normalize_positions(positions, T, "subject token index")


def normalize_positions(positions: Sequence[int], T: int, what: str = "position") -> list[int]:
    out = []
    for p in positions:
        if not isinstance(p, int) or isinstance(p, bool):
            raise PipatchError(f"{what} {p!r} is not an integer")
        if not -T <= p < T:
            raise PipatchError(f"{what} {p} is out of range for a prompt of {T} tokens: use 0..{T - 1} or -{T}..-1")
        out.append(p % T)
    return out


def sweep_positions(positions: Sequence[int] | None, T: int) -> list[int]:
    """The positions a sweep covers: all of a ``T``-token prompt by default, else the checked list."""
    if positions is None:
        return list(range(T))
    cols = normalize_positions(list(positions), T)
    if not cols:
        raise PipatchError("positions is empty: pass at least one position, or omit it for all")
    return cols


def check_choice(value: Any, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise PipatchError(f"unknown {what} {value!r}: use one of {', '.join(choices)}")
    return value


def layer_labels(model) -> list[str]:
    return [str(i) for i in range(adapter_for(model).n_layers)]


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("pipatch", "torch", "nnsight", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "?"
    return out


def model_meta(model) -> dict[str, Any]:
    from .._models import model_name

    hf = getattr(model, "_module", model)
    param = next(hf.parameters())
    return {"model": model_name(model), "family": adapter_for(model).family, "dtype": str(param.dtype).replace("torch.", ""),
            "device": str(param.device), "versions": library_versions()}
