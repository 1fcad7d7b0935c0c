"""Loading SAEs without a model (``pipatch/_features``): both folder formats read into the same
math, what pipatch does not support is one line, a release without SAELens or without a hub
is one line, and hook names map through an adapter (built by hand here: no model) to the
module each family keeps the value in."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import pipatch
from pipatch._model.features.hooks import Hook, locate
from pipatch._model.features.sae import from_release, read_folder
from pipatch._model.models import Adapter
from tests._saes import D_SAE, KINDS, random_weights, save_gemma_scope, save_saelens


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and ": " in text, text
    return text


@pytest.mark.parametrize("kind", KINDS)
def test_a_saelens_folder_loads_without_a_model(kind, tmp_path):
    out = "blocks.0.hook_mlp_out" if kind == "transcoder" else None
    hook = "blocks.0.hook_mlp_in" if kind == "transcoder" else "blocks.0.hook_resid_post"
    weights = random_weights(kind, 16, 16)
    sae = pipatch.load_sae(save_saelens(tmp_path / kind, kind, weights, hook, "tiny-llama", out))
    assert (sae.d_in, sae.d_sae, sae.d_out, sae.hook, sae.hook_out) == (16, D_SAE, 16, hook, out)
    assert sae.transcoder == (kind == "transcoder") and sae.model_name == "tiny-llama"
    assert sae.apply_b_dec_to_input == (kind == "relu") and (sae.W_skip is not None) == (kind == "transcoder")
    latents = sae.encode(torch.randn(5, 16))
    assert latents.shape == (5, D_SAE) and bool((latents >= 0).all())
    if kind == "topk":
        assert int((latents > 0).sum(-1).max()) <= sae.k


def test_both_folder_formats_read_into_the_same_math(tmp_path):
    weights = random_weights("transcoder", 16, 24)
    lens = read_folder(save_saelens(tmp_path / "lens", "transcoder", weights, "a", "m", hook_out="b"))
    scope = read_folder(save_gemma_scope(tmp_path / "scope", weights, "a", "m", hook_out="b"))
    x = torch.randn(3, 16)
    assert torch.equal(lens.encode(x), scope.encode(x)) and torch.equal(lens.reconstruct(x), scope.reconstruct(x))
    assert (scope.hook, scope.hook_out, scope.d_out) == ("a", "b", 24)


def _edited_cfg(folder, **changes):
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg.update(changes)
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("change, says", [
    ({"architecture": "gated"}, "architecture 'gated'"),
    ({"normalize_activations": "layer_norm"}, "normalizes its input"),
    ({"metadata": {"hook_name": "blocks.0.attn.hook_z", "hook_head_index": 2}}, "one attention head"),
    ({"metadata": {}}, "names no hook"),
])
def test_what_pipatch_does_not_read_is_one_line(change, says, tmp_path):
    folder = save_saelens(tmp_path / "sae", "jumprelu", random_weights("jumprelu", 8), "blocks.0.hook_resid_post", "m")
    with pytest.raises(pipatch.PipatchError, match=says) as error:
        pipatch.load_sae(_edited_cfg(folder, **change))
    one_line(error)


def test_a_folder_in_no_format_or_not_a_folder_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(pipatch.PipatchError, match="holds no SAE") as error:
        pipatch.load_sae(tmp_path / "empty")
    one_line(error)
    with pytest.raises(pipatch.PipatchError, match="is not a folder") as error:
        pipatch.load_sae(str(tmp_path / "nowhere"))
    one_line(error)
    with pytest.raises(pipatch.PipatchError, match="cannot load an SAE from int"):
        pipatch.load_sae(3)


def test_a_jumprelu_without_threshold_is_one_line(tmp_path):
    weights = random_weights("relu", 8)
    folder = save_saelens(tmp_path / "sae", "relu", weights, "blocks.0.hook_resid_post", "m")
    with pytest.raises(pipatch.PipatchError, match="has no threshold") as error:
        pipatch.load_sae(_edited_cfg(folder, architecture="jumprelu"))
    one_line(error)


def test_a_release_without_saelens_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sae_lens", None)  # as if not installed
    with pytest.raises(pipatch.PipatchError, match=r"needs SAELens, which is not installed: pip install 'pipatch\[sae\]'") as e:
        pipatch.load_sae(("gemma-scope-2-270m-pt-res", "layer_12_width_16k_l0_small"))
    one_line(e)
    with pytest.raises(pipatch.PipatchError, match="needs SAELens"):
        pipatch.load_sae("gemma-scope-2-270m-pt-res", sae_id="layer_12_width_16k_l0_small")


def test_a_release_without_the_hub_is_one_line(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(pipatch.PipatchError, match="hub cannot be reached") as error:
        from_release("gemma-scope-2-270m-pt-res", "layer_12_width_16k_l0_small")
    assert "google/gemma-scope-2-270m-pt/resid_post/layer_12_width_16k_l0_small" in one_line(error)
    with pytest.raises(pipatch.PipatchError, match="no SAE 'layer_99'"):
        from_release("gemma-scope-2-270m-pt-res", "layer_99")
    with pytest.raises(pipatch.PipatchError, match="knows no release"):
        from_release("no-such-release", "x")


# -- hook names, through hand-built adapters of three families ----------------------------------------
def adapter(family: str) -> Adapter:
    common = dict(n_layers=4, n_heads=4, n_kv_heads=4, head_dim=8, d_model=32, softcap=None,
                  sublayers_are_contributions=True, unembed="lm_head")
    if family == "gpt2":
        return Adapter(family="gpt2", embed="transformer.wte", blocks="transformer.h", attn="attn", mlp="mlp",
                       out_proj="c_proj", final_norm="transformer.ln_f", attn_norm="ln_1", mlp_norm="ln_2", **common)
    if family == "gemma3":
        return Adapter(family="gemma3_text", embed="model.embed_tokens", blocks="model.layers", attn="self_attn",
                       mlp="mlp", out_proj="o_proj", final_norm="model.norm", attn_norm="input_layernorm",
                       mlp_norm="pre_feedforward_layernorm", attn_post_norm="post_attention_layernorm",
                       mlp_post_norm="post_feedforward_layernorm", **common)
    return Adapter(family="llama", embed="model.embed_tokens", blocks="model.layers", attn="self_attn", mlp="mlp",
                   out_proj="o_proj", final_norm="model.norm", attn_norm="input_layernorm",
                   mlp_norm="post_attention_layernorm", **common)


@pytest.mark.parametrize("family, name, want", [
    ("llama", "blocks.2.hook_resid_post", Hook(2, "resid_post", "", False)),
    ("llama", "blocks.3.hook_resid_pre", Hook(2, "resid_post", "", False)),
    ("llama", "blocks.1.hook_mlp_out", Hook(1, "mlp_output", "mlp", False)),
    ("gemma3", "blocks.1.hook_mlp_out", Hook(1, "mlp_output", "post_feedforward_layernorm", False)),
    ("gemma3", "blocks.1.hook_attn_out", Hook(1, "attn_out", "post_attention_layernorm", False)),
    ("gpt2", "blocks.1.hook_attn_out", Hook(1, "attn_out", "attn", False)),
    ("gpt2", "blocks.0.attn.hook_z", Hook(0, "z", "attn.c_proj", True)),
    ("gpt2", "blocks.0.ln2.hook_normalized", Hook(0, "mlp_input", "mlp", True)),
    ("gemma3", "model.layers.3.output", Hook(3, "resid_post", "", False)),
    ("gemma3", "model.layers.3.self_attn.o_proj.input", Hook(3, "z", "self_attn.o_proj", True)),
    ("gemma3", "model.layers.3.pre_feedforward_layernorm.output", Hook(3, "mlp_input", "mlp", True)),
    ("gemma3", "model.layers.3.post_feedforward_layernorm.output", Hook(3, "mlp_output", "post_feedforward_layernorm", False)),
    ("llama", "model.layers.0.post_attention_layernorm.output", Hook(0, "mlp_input", "mlp", True)),
    ("llama", "model.layers.0.mlp", Hook(0, "mlp_output", "mlp", False)),
    # Another family's spelling, read by meaning:
    ("gpt2", "model.layers.2.self_attn.o_proj.input", Hook(2, "z", "attn.c_proj", True)),
    ("gpt2", "model.layers.2.mlp.output", Hook(2, "mlp_output", "mlp", False)),
    ("llama", "transformer.h.1", Hook(1, "resid_post", "", False)),
])
def test_hook_names_map_through_the_adapter(family, name, want):
    assert locate(name, adapter(family)) == want


@pytest.mark.parametrize("name, says", [
    ("blocks.0.hook_resid_pre", "reads the embedding output"),
    ("blocks.4.hook_resid_post", "has 4 layers"),
    ("blocks.1.hook_resid_mid", "not one pipatch reads"),
    ("model.layers.1.self_attn.q_proj.output", "names no value pipatch reads"),
    ("model.layers.1.input", "names no value pipatch reads"),
    ("encoder.block.1", "neither a TransformerLens hook name"),
    ("", "neither a TransformerLens hook name"),
])
def test_a_hook_pipatch_cannot_place_is_one_line(name, says):
    with pytest.raises(pipatch.PipatchError, match=says) as error:
        locate(name, adapter("llama"))
    one_line(error)
