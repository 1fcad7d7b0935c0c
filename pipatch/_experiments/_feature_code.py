"""The feature experiments' part of ``Result.code()``'s script: ``features`` (which latents fire
where, :mod:`pipatch._experiments.features`) and ``feature_patch`` (the screening and the exact
latent patches, :mod:`pipatch._experiments.feature_patch`), written out with plain nnsight and
torch.

The SAE's math is spelled out in the script, as :class:`pipatch._model.features.sae.SAE` computes
it: ``load_sae`` reads the weights from the safetensors file the SAE was loaded from (under
SAELens's tensor names, Gemma Scope 2's renamed), ``encode`` applies the architecture's
activation (JumpReLU's threshold, TopK's k largest, ReLU), ``decode`` is ``f W_dec + b_dec``, a
transcoder adds its affine skip, and a write keeps the SAE's error ``value − reconstruction``,
so an unedited write is the plain run. What the script needs of each SAE comes from the
result's ``meta["saes"][i]["recipe"]`` (:meth:`pipatch._model.features.site.LatentSite.describe`).

For a feature read the script runs the prompt once, encodes each SAE's value and keeps the
``k`` largest latents at each position (its grid: their activations; ``EXTRA["latents"]``
their ids). For a feature patch it runs the clean prompt, then the corrupt one with gradients
(the embedding output a leaf, as attribution patching does), scores every (latent, position)
cell as ``(f_clean − f_corrupt) · dM/df`` and the error row as ``(e_clean − e_corrupt) ·
dM/dx`` summed over the width (its grid: ``corrupt + score`` as normalized recovery, on the
result's rows), and patches the cells the result checked, one run each
(``EXTRA["exact"]``: ``[row, column, metric]``).

An SAE not read from a folder (an SAELens object or release) cannot be loaded by the script:
:class:`~pipatch.PipatchError` in one line.
"""

from __future__ import annotations

from string import Template
from typing import Any

from .._model.models import Adapter, PipatchError
from .._model.sites import Site
from .._results import code as _code

__all__ = ["features_code", "feature_patch_code", "features_inputs"]

_SAE_MATH = Template('''
from safetensors.torch import load_file  # noqa: E402  (the SAE's weights, as its folder keeps them)


def load_sae(recipe):
    """An SAE's tensors from the safetensors file it was loaded from, under SAELens's names:
    W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out], b_dec [d_out] (and threshold
    [d_sae], W_skip [d_out, d_in] where it has them); the rest of `recipe` says how it encodes."""
    stored = load_file(recipe["file"])
    sae = dict(recipe)
    for ours, theirs in recipe["tensors"].items():
        tensor = stored[theirs].T if ours in recipe["transposed"] else stored[theirs]
        sae[ours] = tensor.to(DEVICE, getattr(torch, recipe["dtype"]))
    return sae


def encode(sae, x):
    """The SAE's latents [..., d_sae] of activations x [..., d_in], in the SAE's dtype."""
    x = x.to(sae["W_enc"].dtype)
    if sae["apply_b_dec_to_input"]:
        x = x - sae["b_dec"]
    pre = x @ sae["W_enc"] + sae["b_enc"]
    if sae["rescale_by_decoder_norm"]:  # TopK trained with each latent scaled by its decoder norm
        pre = pre * sae["W_dec"].norm(dim=-1)
$activations


def decode(sae, latents):
    """What latents [..., d_sae] stand for: latents · W_dec + b_dec, [..., d_out]."""
    if sae["rescale_by_decoder_norm"]:
        latents = latents * (1 / sae["W_dec"].norm(dim=-1))
    return latents @ sae["W_dec"] + sae["b_dec"]


def skip(sae, x):
    """A transcoder's affine skip x · W_skipᵀ (0 without one)."""
    return x.to(sae["W_enc"].dtype) @ sae["W_skip"].T if "W_skip" in sae else 0


def error(sae, x, out):
    """What the SAE misses of `out` (the value it writes; x, the value it reads, for a
    transcoder): out − (decode(encode(x)) + skip). Kept on every write."""
    return out.to(sae["W_enc"].dtype) - (decode(sae, encode(sae, x)) + skip(sae, x))


def value_at(layer, place):
    """Inside a trace: the value at `place` = [module path under block `layer` ("": the block),
    whether it is the module's input], [1, T, width]."""
    path, is_input = place
    module = layers[layer]
    for name in path.split(".") if path else []:
        module = getattr(module, name)
    return module.input if is_input else first(module.output)
''')

#: Each activation's lines of ``encode`` (after ``pre``); ReLU, the fall-through, comes last.
_ACTIVATIONS = {
    "jumprelu": '''\
    if sae["activation"] == "jumprelu":  # JumpReLU: a ReLU that is 0 up to each latent's threshold
        return torch.relu(pre) * (pre > sae["threshold"]).to(pre.dtype)''',
    "topk": '''\
    if sae["activation"] == "topk":  # TopK: the k largest per position, through a ReLU; the rest 0
        values, indices = torch.topk(pre, k=sae["k"], dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values.relu())''',
    "relu": '''\
    return torch.relu(pre)  # ReLU''',
}

_FEATURES = Template('''

SAES = {
$saes
}


def features(prompt, positions, k):
    """Which latents fire where: each SAE's k largest latents at each position in `positions`,
    from one run of the prompt. Returns ({SAE: activations [1, k, positions], NaN where fewer
    than k fire}, None, None); their ids go to EXTRA["latents"] (None: none fires)."""
    ids = tokens(prompt)
    # Each place an SAE reads, once, in forward order (nnsight serves modules in that order).
    places = sorted({(sae["layer"], sae["order"], *sae["reads"]) for sae in SAES.values()})
    with model.trace(ids, **LAST_ONLY):
        reads = nnsight.save({})
        for layer, _, path, is_input in places:
            reads[layer, path, is_input] = value_at(layer, (path, is_input)).clone()
    raw, EXTRA["latents"] = {}, {}
    for view, sae in SAES.items():
        latents = encode(sae, reads[(sae["layer"], *sae["reads"])][0]).float()[positions]  # [positions, d_sae]
        values, top = latents.topk(min(k, latents.shape[-1]), dim=-1)
        short = k - values.shape[-1]  # an SAE narrower than k: its last ranks never fire
        values = torch.cat([values, values.new_zeros(len(positions), short)], -1).T  # [k, positions]
        top = torch.cat([top, top.new_zeros(len(positions), short)], -1).T
        fired = values > 0  # only latents that fire are shown
        raw[view] = torch.where(fired, values, float("nan"))[None]
        EXTRA["latents"][view] = [[int(i) if f else None for i, f in zip(row, fires)]
                                  for row, fires in zip(top.tolist(), fired.tolist())]
    return raw, None, None
''')

_FEATURE_PATCH = Template('''

SAE = load_sae($recipe)
VIEW = $view
# The grid's rows: the latents pipatch chose (those of the top_k cells of largest |score|, or
# the ones asked for), then the SAE's error; CHECKS: the (row, column) cells it patched exactly.
LATENTS = $latents
CHECKS = $checks


def feature_patch(clean_prompt, corrupt_prompt, answer, foil, positions):
    """Feature patching: every (latent, position) cell screened by attribution,
    (f_clean − f_corrupt) · dM/df at the corrupt run (the error row: (e_clean − e_corrupt) · dM/dx
    summed over the width), then the CHECKS cells denoised exactly, one run each: the clean
    latent (or error) written at one position, the rest of the SAE's value and its error kept.
    Returns ({VIEW: corrupt metric + score [1, rows, positions]}, clean metric, corrupt metric
    [1]); the exact patches go to EXTRA["exact"] as [row, column, metric]."""
    layer, transcoder = SAE["layer"], SAE["transcoder"]
    clean_ids, corrupt_ids = tokens(clean_prompt), tokens(corrupt_prompt)
    # The clean run: the value the SAE reads and (a transcoder) the MLP output it writes.
    # (A trace hands back the values it saves only.)
    with model.trace(clean_ids, **LAST_ONLY):
        clean_x = value_at(layer, SAE["reads"]).clone().save()
        if transcoder:
            clean_out = value_at(layer, SAE["writes"]).clone().save()
        clean = metric(model.output.logits[0, -1], answer, foil).save()
    clean_out = clean_out if transcoder else clean_x
    f_clean, e_clean = encode(SAE, clean_x[0]), error(SAE, clean_x[0], clean_out[0])  # [T, d_sae], [T, d_out]

    # The corrupt run with gradients. The embedding output becomes a leaf that needs a gradient
    # and the backward stops there: activations get gradients, the weights none.
    with torch.enable_grad(), model.trace(corrupt_ids, **LAST_ONLY):
        embed = model.$embed
        leaf = embed.output.detach().requires_grad_(True)
        embed.output = leaf
        if transcoder:
            corrupt_x = value_at(layer, SAE["reads"]).detach().clone().save()
        out = value_at(layer, SAE["writes"])
        corrupt_out = out.detach().clone().save()
        value = metric(model.output.logits[0, -1], answer, foil)
        corrupt = value.detach().save()
        with value.backward(inputs=[leaf]):
            grad = out.grad.detach().clone().save()
    corrupt_x = corrupt_x if transcoder else corrupt_out
    f_corrupt, e_corrupt = encode(SAE, corrupt_x[0]), error(SAE, corrupt_x[0], corrupt_out[0])

    # A latent reaches the metric through decode only: dM/df = dM/dx · W_decᵀ.
    dx = grad[0].to(f_corrupt.dtype)
    df = dx @ SAE["W_dec"].T
    if SAE["rescale_by_decoder_norm"]:
        df = df * (1 / SAE["W_dec"].norm(dim=-1))
    latent_scores = ((f_clean.float() - f_corrupt.float()) * df.float())[positions].T  # [d_sae, positions]
    error_scores = ((e_clean.float() - e_corrupt.float()) * dx.float())[positions].sum(-1)  # [positions]
    rows = [latent for latent in LATENTS if latent != "error"]
    raw = (corrupt + torch.cat([latent_scores[rows], error_scores[None]]))[None]

    exact = []
    for row, col in CHECKS:
        latent, position = LATENTS[row], positions[col]
        with model.trace(corrupt_ids, **LAST_ONLY):
            x = value_at(layer, SAE["reads"]).clone() if transcoder else None
            out = value_at(layer, SAE["writes"])
            x = out.clone() if x is None else x
            latents, kept = encode(SAE, x[0]), error(SAE, x[0], out[0])
            if latent == "error":
                kept[position] = e_clean[position]
            else:
                latents[position, latent] = f_clean[position, latent]
            out[0] = (decode(SAE, latents) + skip(SAE, x[0]) + kept).to(out.dtype)  # the error kept
            patched = metric(model.output.logits[0, -1], answer, foil).save()
        exact.append([row, col, float(patched)])
    EXTRA["exact"] = exact
    return {VIEW: raw}, clean, corrupt.reshape(1)
''')


def _recipes(result: Any) -> list[dict[str, Any]]:
    """Each SAE's recipe (``meta["saes"][i]["recipe"]``), its module paths checked."""
    recipes = []
    for entry in result.meta["saes"]:
        recipe = entry["recipe"]
        if recipe is None:
            raise PipatchError(f"code() loads each SAE from the folder it was read from; {entry['name']!r} was not read "
                               "from one (an SAELens object or release): save it to a folder (SAELens's save_model) "
                               "and load that")
        for place in ("reads", "writes"):
            path = recipe[place][0]
            if path:
                _code.dotted_path(path, f"SAE {place}")
        recipes.append(recipe)
    return recipes


def _sae_math(recipes: list[dict[str, Any]]) -> str:
    """The script's SAE helpers, ``encode`` with the activations these SAEs use."""
    used = {recipe["activation"] for recipe in recipes}
    lines = [_ACTIVATIONS[name] for name in ("jumprelu", "topk") if name in used]
    lines.append(_ACTIVATIONS["relu"] if "relu" in used else '    raise ValueError(sae["activation"])')
    return _SAE_MATH.substitute(activations="\n".join(lines))


def features_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """A feature read's part of ``Result.code()``'s script (assembled by
    :func:`pipatch._results.code.script`): the name of its function, its code, the sites it reads
    (none of pipatch's: it reads each SAE's own place) and a summary."""
    recipes = _recipes(result)
    saes = "\n".join(f"    {entry['name']!r}: load_sae({recipe!r})," for entry, recipe in zip(result.meta["saes"], recipes))
    code = _sae_math(recipes) + _FEATURES.substitute(saes=saes)
    summary = ("each SAE's latents from one run, the SAE's math spelled out, and the k largest at each\n"
               "position (their activations; their ids in the JSON's \"latents\").")
    return "features", code, [], summary


def feature_patch_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """A feature patch's part of ``Result.code()``'s script: its function's name, its code,
    the sites it reads (none of pipatch's) and a summary."""
    (recipe,) = _recipes(result)
    meta = result.meta
    if meta.get("direction", "denoise") != "denoise":
        raise PipatchError(f"code() writes denoising feature patches; this one is direction={meta['direction']!r}: "
                           "run feature_patch with the default direction for a script, or read this result's frame()")
    checks = [[int(e["layer"]), int(e["col"])] for e in meta["verified_values"]]
    code = _sae_math([recipe]) + _FEATURE_PATCH.substitute(
        recipe=repr(recipe), view=repr(result.views[0]), latents=repr(list(meta["latents"])), checks=repr(checks),
        embed=_code.dotted_path(adapter.embed, "embedding"))
    summary = ("feature patching, every (latent, position) cell screened by gradient × (clean − corrupt)\n"
               "latents through the SAE's math spelled out, as normalized recovery; the checked cells patched\n"
               "exactly (the JSON's \"exact\": [row, column, metric]).")
    return "feature_patch", code, [], summary


def features_inputs(meta: dict) -> dict[str, Any]:
    """A feature read's inputs to the script's ``features``: the prompt, positions and k."""
    return {"prompt": meta["prompt"], "positions": list(meta["positions"]), "k": int(meta["k"])}
