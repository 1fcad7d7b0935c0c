"""The adapter on every supported family, proven on tiny random-weight models (no download).

Real transformers models, real nnsight traces, no mocks. For each family:

* the adapter finds every site and reads the sizes off the config (GQA included);
* every site reads with the shape the engine expects;
* ``Adapter.logits`` on the unembedding's input reproduces the model's own logits (softcap);
* writing a site's own clean value back changes nothing;
* a real patch (corrupt run, clean value written at one layer/position/head) through nnsight
  equals the same patch done with plain PyTorch hooks, and changes the output;
* the quirks the engine relies on: which blocks return tuples and what ``skip()`` needs, and
  Falcon's MLP output being modified in place after the module returns.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pipatch._backends import backend_for
from pipatch._model.models import PipatchError, _get, adapter_for, first
from pipatch._model.sites import SITES as SITE
from tests._reference import hooked, logits_of, torch_patch
from tests._tiny import FAMILIES, SUBLAYER_REFUSED, VARIANTS, VOCAB_SIZE, tiny_model

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Big Ben is in the city of"  # same length, subject differs
SITES = ("resid", "attn", "mlp", "head")
ATOL = 1e-5
ALL = FAMILIES + VARIANTS  # every layout with attention / MLP / head sites

# What each tiny config asks for: (n_kv_heads, block output is a tuple).
EXPECTED = {
    "gemma2": (2, False),
    "gemma3": (2, False),
    "llama": (2, False),
    "mistral": (2, False),
    "qwen2": (2, False),
    "qwen3": (2, False),
    "gpt2": (4, False),
    "gpt_neox": (4, False),
    "phi3": (2, False),
    "falcon": (1, True),  # Falcon-7B layout: multi-query attention
    "falcon_new": (2, True),  # Falcon-40B layout: grouped-query attention
    "gemma3_mm": (2, False),
    "bloom": (4, True),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a busy 2-core machine the
    spinning threads make this file 3-4x slower; restore the setting for the next module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def model_for(family: str):
    return tiny_model(family)


def ids(model, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def subject_position(model) -> int:
    """Index of the last subject token ("Tower"): differs between clean and corrupt."""
    a, b = ids(model, CLEAN)[0], ids(model, CORRUPT)[0]
    assert a.shape == b.shape
    differ = (a != b).nonzero().flatten().tolist()
    assert differ, "clean and corrupt tokenize the same"
    return differ[-1]


# --------------------------------------------------------------------------------------------
# The tiny models themselves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_tiny_tokenizer_has_the_words(family):
    model = model_for(family)
    tok = model.tokenizer
    config = getattr(model._module.config, "text_config", None) or model._module.config
    assert len(tok) == VOCAB_SIZE == config.vocab_size
    for answer in (" Paris", " Rome"):
        assert len(tok(answer, add_special_tokens=False).input_ids) == 1
    enc = tok(CLEAN, return_offsets_mapping=True, add_special_tokens=False)
    assert tok.unk_token_id not in enc.input_ids
    words = [CLEAN[s:e] for s, e in enc.offset_mapping]
    assert words == CLEAN.split()
    assert tok.decode(enc.input_ids) == CLEAN


# --------------------------------------------------------------------------------------------
# Sites and sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_adapter_finds_sites_and_sizes(family):
    model = model_for(family)
    hf = model._module
    config = getattr(hf.config, "text_config", None) or hf.config
    adapter = adapter_for(model)
    assert adapter is adapter_for(hf)  # cached on the HF module, same for both handles
    assert adapter.n_layers == config.num_hidden_layers
    assert adapter.n_heads == config.num_attention_heads
    assert adapter.d_model == config.hidden_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert adapter.head_dim == head_dim
    if family in ("gemma2", "gemma3", "gemma3_mm", "qwen3"):
        assert adapter.n_heads * adapter.head_dim != adapter.d_model  # z wider than the stream
    assert adapter.n_kv_heads == EXPECTED[family][0]
    assert adapter.final_norm is not None
    assert adapter.softcap == (1.0 if family == "gemma2" else None)
    assert adapter.trace_kwargs() == {"logits_to_keep": 1} and adapter.trace_kwargs(2) == {"logits_to_keep": 2}  # baselines unembed the last position only
    if family == "gemma3_mm":
        assert adapter.blocks == "model.language_model.layers"
        assert adapter.family == "gemma3_text"

    block = _get(hf, adapter.blocks)[0]
    assert "Attention" in type(_get(block, adapter.attn)).__name__
    assert "MLP" in type(_get(block, adapter.mlp)).__name__
    proj = _get(_get(block, adapter.attn), adapter.out_proj)
    # Linear (in_features) or GPT-2's Conv1D (nx): z is n_heads * head_dim wide.
    width = getattr(proj, "in_features", None) or proj.nx
    assert width == adapter.n_heads * adapter.head_dim
    unembed = adapter.unembedding(hf)
    assert unembed.weight.shape == (VOCAB_SIZE, adapter.d_model)


@pytest.mark.parametrize("family", ALL)
def test_site_shapes_inside_a_trace(family):
    model = model_for(family)
    a = adapter_for(model)
    T = ids(model, CLEAN).shape[1]
    d, z_width = a.d_model, a.n_heads * a.head_dim
    with torch.no_grad(), model.trace(CLEAN):
        got = [].save()
        for layer in range(a.n_layers):
            # Modules must be read in the order they run: z, attention, MLP, block.
            z, attn, mlp, block = (SITE[name].value(a, model, layer) for name in ("head", "attn", "mlp", "resid"))
            got.append((tuple(z.shape), tuple(attn.shape), tuple(mlp.shape), tuple(block.shape)))
        unembed_in = a.unembedding(model).input.save()
        logits = model.output.logits.save()
    for layer_shapes in got:
        assert layer_shapes == ((1, T, z_width), (1, T, d), (1, T, d), (1, T, d))
    assert unembed_in.shape == (1, T, d)
    assert logits.shape == (1, T, VOCAB_SIZE)


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_logits_from_unembedding_input(family):
    model = model_for(family)
    a = adapter_for(model)
    with torch.no_grad(), model.trace(CLEAN):
        hidden = a.unembedding(model).input[:, -1].save()
        logits = model.output.logits[:, -1].save()
    backend = backend_for(model)
    assert torch.allclose(backend.logits(hidden), logits, atol=ATOL, rtol=0)
    paris, rome = (model.tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" Paris", " Rome"))
    subset = backend.logits(hidden, [paris, rome])
    assert torch.allclose(subset, logits[:, [paris, rome]], atol=ATOL, rtol=0)
    if a.softcap:
        # The cap really is on: the raw product differs and the capped logits are bounded.
        raw = torch.nn.functional.linear(hidden, a.unembedding(model._module).weight)
        assert (raw - logits).abs().max() > 1e-2
        assert logits.abs().max() < a.softcap


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_a_probability_from_the_unembedding_in_slices_equals_the_softmax(family):
    """A probability metric never holds the whole vocabulary's logits: the log-sum-exp is taken
    over slices of the unembedding's rows (333 of the 1,000 here, the last slice shorter) and
    combined; soft-capping included. Against float64 over the model's own logits."""
    from pipatch._model.cells import Metric

    model = model_for(family)
    a = adapter_for(model)
    with torch.no_grad(), model.trace(CLEAN):
        hidden = a.unembedding(model).input.save()
        logits = model.output.logits.save()
    backend = backend_for(model)
    T = hidden.shape[1]
    want = torch.logsumexp(logits.double(), -1)
    got = backend.logsumexp(hidden, budget=333 * T)
    assert got.shape == want.shape and torch.allclose(got.double(), want, atol=ATOL, rtol=0)
    paris, rome = (model.tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" Paris", " Rome"))
    # Two read positions of one input: a two-token answer's log-probability, teacher-forced.
    for metric in (Metric("prob", (paris,)), Metric("logprob", (paris, rome))):
        rows = hidden[:, -metric.n_read:][:, None]  # [1, inputs, n_read, d]
        logprobs = torch.log_softmax(logits[0, -metric.n_read:].double(), -1)
        reference = sum(logprobs[j, token] for j, token in enumerate(metric.answer))
        reference = reference.exp() if metric.name == "prob" else reference
        got = backend.metric_from_hidden(metric, rows)
        assert got.shape == (1,) and abs(float(got[0]) - float(reference)) < ATOL, (metric, got, reference)


def test_bloom_refuses_sublayer_sites():
    model = model_for("bloom")
    a = adapter_for(model)
    assert not a.sublayers_are_contributions
    for site in ("attn", "mlp", "head"):
        with pytest.raises(PipatchError, match="resid"):
            SITE[site].check(a)
    assert SITE["resid"].check(a).module(a, model, 0) is not None


# --------------------------------------------------------------------------------------------
# Writes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("family", ALL)
def test_writing_clean_back_changes_nothing(family, site):
    """Save every layer's site value, then write it back position by position: same logits."""
    model = model_for(family)
    a = adapter_for(model)
    T = ids(model, CLEAN).shape[1]
    positions = sorted({0, subject_position(model), T - 2, T - 1})

    def read(layer):
        return SITE[site].value(a, model, layer)

    with torch.no_grad(), model.trace(CLEAN):
        saved = [].save()
        for layer in range(a.n_layers):
            saved.append(read(layer).clone())
        clean = model.output.logits.save()
    with torch.no_grad(), model.trace(CLEAN):
        for layer in range(a.n_layers):
            value = read(layer)
            for pos in positions:
                value[:, pos] = saved[layer][:, pos]
        patched = model.output.logits.save()
    assert torch.allclose(patched, clean, atol=ATOL, rtol=0)


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("family", ALL)
def test_nnsight_patch_equals_torch_hook_patch(family, site):
    """Clean value into the corrupt run at (layer, subject position[, head 1]), two ways."""
    model = model_for(family)
    a = adapter_for(model)
    clean_ids, corrupt_ids = ids(model, CLEAN), ids(model, CORRUPT)
    pos = subject_position(model)
    layer = 1
    head = 1 if site == "head" else None
    sl = slice(head * a.head_dim, (head + 1) * a.head_dim) if head is not None else slice(None)

    def read():
        return SITE[site].value(a, model, layer)

    with torch.no_grad(), model.trace(clean_ids):
        donor = read().clone().save()
    with torch.no_grad(), model.trace(corrupt_ids):
        read()[:, pos, sl] = donor[:, pos, sl]
        patched = model.output.logits.save()
    corrupt = logits_of(model, corrupt_ids)
    reference = torch_patch(model, site, layer, pos, head, clean_ids, corrupt_ids)
    assert torch.allclose(patched, reference, atol=ATOL, rtol=0)
    # The patch did something: the logits after the subject moved.
    assert (patched[:, pos:] - corrupt[:, pos:]).abs().max() > 1e-4
    # ... and nothing before it (causal masking).
    assert torch.allclose(patched[:, :pos], corrupt[:, :pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_whole_residual_patch_restores_clean(family):
    """Clean residual at every position of layer L into the corrupt run gives the clean logits."""
    model = model_for(family)
    a = adapter_for(model)
    clean_ids, corrupt_ids = ids(model, CLEAN), ids(model, CORRUPT)
    clean = logits_of(model, clean_ids)
    for layer in range(a.n_layers):
        with torch.no_grad(), model.trace(clean_ids):
            donor = first(a.block(model, layer).output).clone().save()
        with torch.no_grad(), model.trace(corrupt_ids):
            first(a.block(model, layer).output)[:] = donor
            patched = model.output.logits.save()
        assert torch.allclose(patched, clean, atol=ATOL, rtol=0), layer


@pytest.mark.parametrize("family", ALL)
def test_qkv_columns_feed_the_head_they_name(family):
    """``Adapter.qkv_columns`` against what the attention itself does with those columns.

    A random change δ is written into the named columns at one position p, and the heads'
    outputs ``z`` (the output projection's input) are compared with the unchanged run. What
    changes tells the columns apart without trusting any layout:

    * a query of head h changes only head h, only at position p;
    * a key or value of head h changes every head sharing h's key/value head, at all positions
      ≥ p that attend to p; a value enters ``z`` linearly (2δ moves it twice as far), a key
      through the softmax.
    """
    model = model_for(family)
    a = adapter_for(model)
    hf = model._module
    layer, p = 1, 2
    input_ids = ids(model, CLEAN)
    T, group = input_ids.shape[1], a.n_heads // a.n_kv_heads
    attn = _get(_get(hf, a.blocks)[layer], a.attn)
    out_proj = _get(attn, a.out_proj)
    delta = torch.randn(a.head_dim, generator=torch.Generator().manual_seed(0))

    def z_with(name=None, lo=0, hi=0, scale=0.0):
        seen = {}
        hooks = [(out_proj, "pre", lambda m, args: seen.__setitem__("z", args[0].clone()))]
        if name is not None:
            def shift(m, args, out):
                out = out.clone()
                out[:, p, lo:hi] += scale * delta
                return out
            hooks.append((_get(attn, name), "post", shift))
        hooked(hooks, lambda: logits_of(model, input_ids))
        return seen["z"][0].reshape(T, a.n_heads, a.head_dim)

    # Keys and values at p reach the queries at p.. (p + window - 1) under a sliding window.
    config = getattr(hf.config, "text_config", None) or hf.config
    sliding = (getattr(config, "layer_types", None) or [None] * a.n_layers)[layer] == "sliding_attention"
    reach = min(T, p + config.sliding_window) if sliding else T
    base = z_with()
    for head in range(a.n_heads):
        for which in ("q", "k", "v"):
            name, lo, hi = a.qkv_columns(which, head)
            assert hi - lo == a.head_dim
            one, two = z_with(name, lo, hi, 1.0) - base, z_with(name, lo, hi, 2.0) - base
            moved = one.abs().amax(-1) > 1e-6  # [T, heads]
            heads = set(moved.any(0).nonzero().flatten().tolist())
            positions = set(moved.any(1).nonzero().flatten().tolist())
            where = (family, which, head)
            if which == "q":
                assert (heads, positions) == ({head}, {p}), where
            else:
                assert heads == {h for h in range(a.n_heads) if h // group == head // group}, where
                assert positions == set(range(p, reach)), where
                linear = torch.allclose(two, 2 * one, atol=1e-5, rtol=1e-4)
                assert linear == (which == "v"), where


# --------------------------------------------------------------------------------------------
# Quirks the engine must respect
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_block_output_structure_and_skip(family):
    """Falcon and BLOOM blocks return ``(hidden, attn_weights)``; the rest a bare tensor.

    ``skip()`` must hand back the block's own structure: a tuple where the block returns one
    (the caller does ``outputs[0]``), a tensor elsewhere. Skipping with the captured clean
    output reproduces the clean logits.
    """
    model = model_for(family)
    a = adapter_for(model)
    tuple_block = EXPECTED[family][1]
    with torch.no_grad(), model.trace(CLEAN):
        out = a.block(model, 0).output
        saved = (tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
                 if isinstance(out, tuple) else out.clone()).save()
        clean = model.output.logits.save()
    assert isinstance(saved, tuple) == tuple_block
    if tuple_block:
        hidden, weights = saved  # eager attention: weights [1, heads, T, T]; None under sdpa
        assert hidden.shape[-1] == a.d_model
        assert weights is None or weights.shape[1] == a.n_heads
    with torch.no_grad(), model.trace(CLEAN):
        a.block(model, 0).skip(saved)
        skipped = model.output.logits.save()
    assert torch.allclose(skipped, clean, atol=ATOL, rtol=0)
    if tuple_block:
        # A bare tensor in its place breaks the caller: its ``outputs[0]`` unpacking (a
        # ValueError), or, transformers 5.25 on, Falcon's next shape check (a RuntimeError).
        with pytest.raises((ValueError, RuntimeError), match="unpack|size of tensor"), torch.no_grad(), \
                model.trace(CLEAN):
            a.block(model, 0).skip(saved[0])
            model.output.logits.save()


@pytest.mark.parametrize("family", ALL)
def test_attention_skip_needs_its_tuple(family):
    """Every attention module returns ``(out, weights)`` and its caller unpacks two values.

    ``skip(tensor)`` with batch 2 silently unpacks the *batch* (wrong numbers, no error);
    ``skip((tensor, None))`` is right.
    """
    model = model_for(family)
    a = adapter_for(model)
    with torch.no_grad(), model.trace([CLEAN, CLEAN]):
        out = SITE["attn"].module(a, model, 1).output
        assert isinstance(out, tuple) and len(out) == 2
        value = out[0].clone().save()
        clean = model.output.logits.save()
    with torch.no_grad(), model.trace([CLEAN, CLEAN]):
        SITE["attn"].module(a, model, 1).skip((value, None))
        skipped = model.output.logits.save()
    assert torch.allclose(skipped, clean, atol=ATOL, rtol=0)


def test_falcon_mlp_output_is_modified_in_place():
    """Falcon's block does ``mlp_output += attention_output``: a saved *reference* to the MLP
    output ends up holding MLP + attention. Clone site values when capturing them."""
    model = model_for("falcon")
    a = adapter_for(model)
    with torch.no_grad(), model.trace(CLEAN):
        attn = first(SITE["attn"].module(a, model, 0).output).clone().save()
        mlp_ref = SITE["mlp"].module(a, model, 0).output.save()
        mlp_copy = SITE["mlp"].module(a, model, 0).output.clone().save()
    assert torch.allclose(mlp_ref, mlp_copy + attn, atol=ATOL, rtol=0)
    assert not torch.allclose(mlp_ref, mlp_copy, atol=ATOL)


# --------------------------------------------------------------------------------------------
# The engine's public API on every family
# --------------------------------------------------------------------------------------------


def _api(name: str):
    import pipatch

    fn = getattr(pipatch, name, None)
    if fn is None:  # not exported yet
        from pipatch._experiments import patching, tracing

        fn = getattr(patching, name, None) or getattr(tracing, name)
    return fn


def _sites(family: str) -> tuple[str, ...]:
    return ("resid",) if family in SUBLAYER_REFUSED else SITES


def _patch(model, site: str, clean: str = CLEAN, corrupt: str = CORRUPT, **kwargs):
    return _api("patch")(model, clean=clean, corrupt=corrupt, answer=" Paris", foil=" Rome", site=site, **kwargs)


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_patch_clean_into_clean_is_the_baseline(family):
    """Donor equals base: every write puts back the value already there. Run for real
    (``fast=False``: no pruning, every cell a forward), each cell is the clean baseline; the
    default path, which fills these cells without a forward, gives the same grid."""
    model = model_for(family)
    for site in _sites(family):
        result = _patch(model, site, corrupt=CLEAN, fast=False)
        raw = result.raw[site]
        stats = result.meta["engine"]
        assert stats["cells"] == raw.numel() and stats["noop_cells"] == 0, (site, stats)
        assert stats["traces"] > 0, (site, stats)
        assert not torch.isnan(raw).any(), site
        assert torch.allclose(raw, torch.full_like(raw, result.clean), atol=ATOL, rtol=0), site
        pruned = _patch(model, site, corrupt=CLEAN, fast=True)
        assert pruned.meta["engine"]["noop_cells"] == raw.numel(), (site, pruned.meta["engine"])
        assert torch.allclose(pruned.raw[site], raw, atol=ATOL, rtol=0), site


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_patch_fast_equals_straightforward(family):
    model = model_for(family)
    for site in _sites(family):
        fast = _patch(model, site, fast=True).raw[site]
        slow = _patch(model, site, fast=False).raw[site]
        assert not torch.isnan(fast).any(), site
        assert torch.allclose(fast, slow, atol=1e-4, rtol=0), (site, (fast - slow).abs().max())


@pytest.mark.parametrize("family", ALL)
def test_patch_cells_equal_torch_hook_patches(family):
    """Grid cells from pipatch.patch equal the same patch done with plain PyTorch hooks."""
    model = model_for(family)
    tok = model.tokenizer
    paris, rome = (tok(w, add_special_tokens=False).input_ids[0] for w in (" Paris", " Rome"))
    clean_ids, corrupt_ids = ids(model, CLEAN), ids(model, CORRUPT)
    pos, layer, T = subject_position(model), 1, clean_ids.shape[1]
    for site in SITES:
        if site == "head":
            result = _patch(model, site, positions=[pos])
            got, head = result.raw[site][0, layer, 1], 1
        else:
            result = _patch(model, site)
            got, head = result.raw[site][0, layer, pos], None
        logits = torch_patch(model, site, layer, pos, head, clean_ids, corrupt_ids)[0, -1]
        want = logits[paris] - logits[rome]
        assert abs(float(got) - float(want)) < ATOL, (site, float(got), float(want))
        # Cells of the row really differ, so a wrong column would not pass by accident.
        row = result.raw[site][0, layer]
        assert float(row.max() - row.min()) > 1e-4, site
        # The last layer's residual at the last position is the clean run's.
        if site == "resid":
            assert abs(float(result.raw[site][0, -1, T - 1]) - result.clean) < ATOL


@pytest.mark.parametrize("family", ALL + SUBLAYER_REFUSED)
def test_trace_fast_equals_straightforward_and_control_is_zero(family):
    model = model_for(family)
    kinds = ["resid"] if family in SUBLAYER_REFUSED else ["resid", "mlp", "attn"]
    run = functools.partial(
        _api("trace"), model, CLEAN, subject="Eiffel Tower", answer=" Paris", seeds=2, scale=3.0,
        sites=kinds, window=2, metric="logprob",  # P(answer) of a random model is ~1e-3: too flat
    )
    fast, slow = run(fast=True), run(fast=False)
    for kind in kinds:
        a, b = fast.raw[kind], slow.raw[kind]
        assert not torch.isnan(a).any(), kind
        assert torch.allclose(a, b, atol=1e-4, rtol=0), (kind, (a - b).abs().max())
    control = run(control=True)
    for kind in kinds:
        raw = control.raw[kind]
        assert torch.allclose(raw, control.corrupt_seeds.view(-1, 1, 1).expand_as(raw), atol=ATOL, rtol=0), kind
