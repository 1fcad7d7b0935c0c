"""Path patching against references written with plain PyTorch hooks (no nnsight).

(a) On a tiny random Llama (GQA: 4 query heads, 2 key/value heads) the three-run procedure
    is rebuilt with forward hooks and must give the same metric, for head → q/k/v receivers,
    an MLP sender to the logits, and both directions; and the same for q/k/v receivers in every
    fused-projection layout (GPT-2, GPT-NeoX, Phi-3, both Falcon layouts).
(b) On the embedded Gemma 3 270M, the direct path of a head to the logits must equal its
    definition computed by hand: unembed(norm(base final residual + donor contribution − base
    contribution)), where a head's contribution is what the attention sublayer writes to the
    residual (Gemma normalizes the attention output before adding it) with that head's ``z``.
"""

from __future__ import annotations

import pytest
import torch

import pipatch
from tests._reference import hooked, reference_path
from tests.conftest import COLOSSEUM, EIFFEL

TINY_CLEAN = "The Colosseum is in the city of"
TINY_CORRUPT = "The Kremlin is in the city of"


def value(r) -> float:
    """The path-patched metric of a one-sender result."""
    assert r.kind == "path" and r.raw[r.views[0]].shape == (1, 1, 1)
    return float(r.raw[r.views[0]][0, 0, 0])


def effect(r) -> float:
    """How far the path alone moved the metric from the base run's."""
    base = r.corrupt if r.meta["direction"] == "denoise" else r.clean_value
    return value(r) - base


@pytest.fixture(scope="module")
def tiny():
    from tests._tiny import tiny_model

    return tiny_model("llama")


CASES = [
    (("head", 0, 1), [("head", 2, 0, "q"), ("head", 1, 3, "k"), ("head", 2, 1, "v")], "denoise"),
    (("head", 1, 2), [("head", 2, 3, "k"), ("head", 2, 2, "q")], "noise"),
    (("mlp", 0), [("head", 1, 0, "v")], "denoise"),
    (("mlp", 1), "logits", "denoise"),
    (("head", 0, 3), "logits", "noise"),
]


@pytest.mark.parametrize("sender,receivers,direction", CASES)
def test_tiny_path_effect_equals_a_hook_reference(tiny, sender, receivers, direction):
    r = pipatch.path_patch(tiny, clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow",
                           sender=sender, receivers=receivers, direction=direction)
    base_text, donor_text = (TINY_CORRUPT, TINY_CLEAN) if direction == "denoise" else (TINY_CLEAN, TINY_CORRUPT)
    expected = reference_path(tiny, base_text=base_text, donor_text=donor_text, answer=" Rome", foil=" Moscow",
                              sender=sender, receivers=[] if receivers == "logits" else receivers)
    assert value(r) == pytest.approx(expected, abs=1e-5)
    # The path moved something, or this test could not tell a no-op from a patch.
    assert abs(effect(r)) > 1e-6


FUSED = ["gpt2", "gpt_neox", "phi3", "falcon", "falcon_new"]


@pytest.mark.parametrize("family", FUSED)
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_fused_qkv_receivers_equal_a_hook_reference(family, direction):
    from tests._tiny import tiny_model

    model = tiny_model(family)
    sender, receivers = ("head", 0, 1), [("head", 2, 0, "q"), ("head", 1, 3, "k"), ("head", 2, 1, "v")]
    r = pipatch.path_patch(model, clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow",
                           sender=sender, receivers=receivers, direction=direction)
    base_text, donor_text = (TINY_CORRUPT, TINY_CLEAN) if direction == "denoise" else (TINY_CLEAN, TINY_CORRUPT)
    expected = reference_path(model, base_text=base_text, donor_text=donor_text, answer=" Rome", foil=" Moscow",
                              sender=sender, receivers=receivers)
    assert value(r) == pytest.approx(expected, abs=1e-5)
    assert abs(effect(r)) > 1e-6
    # Each receiver alone carries part of it: no receiver was dropped or written to the wrong place.
    for receiver in receivers:
        alone = pipatch.path_patch(model, clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow",
                                   sender=sender, receivers=[receiver], direction=direction)
        assert value(alone) == pytest.approx(
            reference_path(model, base_text=base_text, donor_text=donor_text, answer=" Rome", foil=" Moscow",
                           sender=sender, receivers=[receiver]), abs=1e-5), receiver


def test_errors_are_one_line(tiny):
    kwargs = dict(clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow")
    with pytest.raises(pipatch.PipatchError, match="not after the sender"):
        pipatch.path_patch(tiny, sender=("head", 1, 0), receivers=[("head", 1, 0, "q")], **kwargs)
    with pytest.raises(pipatch.PipatchError, match="sender"):
        pipatch.path_patch(tiny, sender=("attn", 0), **kwargs)
    with pytest.raises(pipatch.PipatchError, match="out of range"):
        pipatch.path_patch(tiny, sender=("head", 0, 9), **kwargs)
    # A family whose q/k/v layout the adapter does not know refuses q/k/v receivers in one line.
    import dataclasses

    from pipatch._base.known import known as known_of
    from pipatch._model.models import _ADAPTERS, adapter_for

    hf = tiny._module
    known = adapter_for(tiny)
    _ADAPTERS[hf] = dataclasses.replace(known, qkv=(), qkv_layout=None)
    known_of(tiny).backend = None  # the backend caches the adapter it was built with
    try:
        with pytest.raises(pipatch.PipatchError, match="lays out queries, keys and values") as info:
            pipatch.path_patch(tiny, sender=("head", 0, 0), receivers=[("head", 1, 0, "q")], **kwargs)
        assert "\n" not in str(info.value)
        # ... while the direct path, which needs no layout, still runs.
        assert abs(effect(pipatch.path_patch(tiny, sender=("head", 0, 0), receivers="logits", **kwargs))) > 1e-6
    finally:
        _ADAPTERS[hf] = known
        known_of(tiny).backend = None


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_a_sweep_over_senders_equals_one_sender_at_a_time(tiny, direction):
    """The grid over every head (IOI-style) holds, in cell (layer, head), that sender's path value."""
    kwargs = dict(clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow", direction=direction)
    base_text, donor_text = (TINY_CORRUPT, TINY_CLEAN) if direction == "denoise" else (TINY_CLEAN, TINY_CORRUPT)
    grid = pipatch.path_patch(tiny, **kwargs)
    n_layers, n_heads = grid.raw["head"].shape[1:]
    assert grid.kind == "path" and grid.columns == [f"H{h}" for h in range(n_heads)] and grid.status == "done"
    assert grid.meta["engine"]["traces"] >= 1 and grid.meta["engine"]["max_invokes"] > 1  # batched invokes
    for layer in range(n_layers):
        for head in range(n_heads):
            expected = reference_path(tiny, base_text=base_text, donor_text=donor_text, answer=" Rome",
                                      foil=" Moscow", sender=("head", layer, head), receivers=[])
            assert float(grid.raw["head"][0, layer, head]) == pytest.approx(expected, abs=1e-5), (layer, head)
    mlps = pipatch.path_patch(tiny, sender="mlp", **kwargs)
    assert mlps.columns == ["MLP"]
    for layer in range(n_layers):
        one = pipatch.path_patch(tiny, sender=("mlp", layer), **kwargs)
        assert float(mlps.raw["mlp"][0, layer, 0]) == pytest.approx(value(one), abs=1e-5)


def test_a_sweep_through_qkv_receivers_covers_the_senders_below_them(tiny):
    receivers = [("head", 2, 1, "q"), ("head", 2, 3, "v")]
    kwargs = dict(clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow", receivers=receivers)
    grid = pipatch.path_patch(tiny, **kwargs)
    raw = grid.raw["head"][0]
    assert torch.isnan(raw[2:]).all() and not torch.isnan(raw[:2]).any()  # senders at/after layer 2 cannot send
    for layer in range(2):
        for head in range(raw.shape[1]):
            expected = reference_path(tiny, base_text=TINY_CORRUPT, donor_text=TINY_CLEAN, answer=" Rome",
                                      foil=" Moscow", sender=("head", layer, head), receivers=receivers)
            assert float(raw[layer, head]) == pytest.approx(expected, abs=1e-5), (layer, head)


def test_direct_path_to_logits_matches_its_definition(model):
    layer, head = 12, 2
    r = pipatch.path_patch(model, clean=EIFFEL, corrupt=COLOSSEUM, answer=" Paris", foil=" Rome",
                           sender=("head", layer, head), receivers="logits")
    hf, tok = model._module, model.tokenizer
    block = hf.model.layers[layer]
    hd = hf.config.head_dim
    cache = {}

    def run(text):
        hooks = [
            (block.self_attn.o_proj, "pre", lambda m, args: cache.__setitem__("z", args[0].clone())),
            (hf.model.norm, "pre", lambda m, args: cache.__setitem__("final", args[0].clone())),
        ]
        hooked(hooks, lambda: hf(tok(text, return_tensors="pt").input_ids))
        return cache["z"], cache["final"]

    z_clean, _ = run(EIFFEL)
    z_base, final_base = run(COLOSSEUM)
    z_mix = z_base.clone()
    z_mix[:, :, head * hd:(head + 1) * hd] = z_clean[:, :, head * hd:(head + 1) * hd]

    def contribution(z):  # what the attention sublayer adds to the residual stream
        return block.post_attention_layernorm(block.self_attn.o_proj(z))

    with torch.no_grad():
        final = final_base + contribution(z_mix) - contribution(z_base)
        logits = hf.lm_head(hf.model.norm(final))[0, -1]
    paris, rome = (tok(t, add_special_tokens=False).input_ids[0] for t in (" Paris", " Rome"))
    expected = float(logits[paris] - logits[rome])
    print(f"\ndirect path head {layer}.{head} → logits: {value(r):.4f} (corrupt {r.corrupt:.4f}, "
          f"clean {r.clean_value:.4f}, recovery {float(r.grid[0, 0]):.3f}); by hand {expected:.4f}")
    assert value(r) == pytest.approx(expected, abs=1e-4)
    assert abs(effect(r)) > 1e-3
