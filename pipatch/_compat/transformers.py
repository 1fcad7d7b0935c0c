"""transformers' (and its tokenizers') internals that pipatch uses, each behind one function.

Checked on transformers 5.19 and 5.25 (:data:`pipatch._compat.TESTED`). What pipatch needs
beyond the public API, and why:

* a fast tokenizer's post-processor, set where a GGUF tokenizer lacks its BOS template
  (:func:`set_post_processor`);
* which attention implementation a config runs, which decides whether a packed run can hand
  the model a 4-D mask (:func:`attention_implementation`);
* a key/value cache filled with given keys and values, for prefix reuse and packed runs
  (:func:`filled_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import missing

__all__ = ["PRIVATE_NAMES", "PUBLIC_MODULES", "set_post_processor", "attention_implementation", "filled_cache"]

#: transformers' private names (and internal keyword arguments, ending in ``=``) used here
#: and nowhere else in pipatch (``tests/unit/test_compat.py``).
PRIVATE_NAMES = ("_tokenizer", "_attn_implementation", "_name_or_path", "ddp_cache_data=")
#: The modules of transformers pipatch imports outside this file (``tests/unit/test_compat.py``).
PUBLIC_MODULES = ("transformers",)


def set_post_processor(tokenizer: Any, processor: Any) -> None:
    """Give a fast tokenizer the ``tokenizers`` post-processor ``processor`` (the template
    that adds BOS and EOS around a text).

    Private name: ``PreTrainedTokenizerFast._tokenizer`` (the ``tokenizers.Tokenizer`` it
    wraps, whose ``post_processor`` is the template). transformers before 5.2x built a GGUF
    tokenizer's post-processor without the BOS its GGUF asks for, and Gemma without its BOS
    is another model (:func:`pipatch._model.models._with_bos`)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise missing("transformers", "PreTrainedTokenizerFast._tokenizer")
    backend.post_processor = processor


def attention_implementation(*configs: Any) -> str | None:
    """The attention implementation the first of ``configs`` that names one runs
    (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ...), else ``None``.

    Private name: ``PretrainedConfig._attn_implementation`` (transformers keeps the choice
    there; ``attn_implementation=`` at load sets it). pipatch packs a batch's cells only
    where the attention takes a 4-D mask: SDPA's booleans or eager's additive scores."""
    for config in configs:
        implementation = getattr(config, "_attn_implementation", None)
        if implementation:
            return implementation
    return None


def filled_cache(layers: Sequence[tuple[Any, Any]]) -> Any:
    """A ``DynamicCache`` holding layer ``i``'s keys and values ``layers[i] = (k, v)``, each
    ``[batch, kv_heads, positions, head_dim]``: what a run that starts at a later position
    attends to for the positions before it.

    Internal keyword: ``DynamicCache(ddp_cache_data=...)``, documented for rebuilding a cache
    across data-parallel ranks, and the one constructor that takes keys and values
    per layer. A plain cache (no config) keeps every position of every layer, sliding-window
    layers included."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)
