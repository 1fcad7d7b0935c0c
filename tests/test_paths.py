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
    assert r.value == pytest.approx(expected, abs=1e-5)
    assert r.effect == pytest.approx(r.value - r.base)
    # The path moved something, or this test could not tell a no-op from a patch.
    assert abs(r.effect) > 1e-6


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
    assert r.value == pytest.approx(expected, abs=1e-5)
    assert abs(r.effect) > 1e-6
    # Each receiver alone carries part of it: no receiver was dropped or written to the wrong place.
    for receiver in receivers:
        alone = pipatch.path_patch(model, clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow",
                                   sender=sender, receivers=[receiver], direction=direction)
        assert alone.value == pytest.approx(
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

    from pipatch._models import adapter_for

    hf = tiny._module
    known = adapter_for(tiny)
    hf._pipatch_adapter = dataclasses.replace(known, qkv=(), qkv_layout=None)
    try:
        with pytest.raises(pipatch.PipatchError, match="lays out queries, keys and values") as info:
            pipatch.path_patch(tiny, sender=("head", 0, 0), receivers=[("head", 1, 0, "q")], **kwargs)
        assert "\n" not in str(info.value)
        # ... while the direct path, which needs no layout, still runs.
        assert abs(pipatch.path_patch(tiny, sender=("head", 0, 0), receivers="logits", **kwargs).effect) > 1e-6
    finally:
        hf._pipatch_adapter = known


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
    print(f"\ndirect path head {layer}.{head} → logits: {r.value:.4f} (corrupt {r.corrupt:.4f}, "
          f"clean {r.clean:.4f}, recovery {r.recovery:.3f}); by hand {expected:.4f}")
    assert r.value == pytest.approx(expected, abs=1e-4)
    assert abs(r.effect) > 1e-3
