"""References written with plain PyTorch forward hooks, no nnsight: what pipatch must reproduce.

Each runs the Hugging Face module (``model._module``) directly, one forward per cell, the way
a researcher would write the loop by hand. Module *lookup* goes through pipatch's adapter (its
candidate names are what the family tests check); everything else is spelled out here.

* :func:`patch_grid` — activation patching, one (layer, position or head) cell per forward;
* :func:`trace_grid` — ROME causal tracing (noise on the subject's embeddings, one clean
  residual state restored per forward);
* :func:`reference_path` — IOI-style three-run path patching.

All run on the CPU model they are given; the inputs are moved to its device.
"""

from __future__ import annotations

import torch

from pipatch._models import _get, adapter_for


def first(x):
    """The hidden states of a module output that may be a tuple."""
    return x[0] if isinstance(x, tuple) else x


def hooked(module_hooks, run):
    """Run ``run()`` with ``(module, "pre" | "post", hook)`` registered, always removing them."""
    handles = []
    try:
        for module, kind, fn in module_hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            handles.append(register(fn))
        with torch.no_grad():
            return run()
    finally:
        for handle in handles:
            handle.remove()


def _device(hf) -> torch.device:
    return next(hf.parameters()).device


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    hf = model._module
    with torch.no_grad():
        return hf(input_ids.to(_device(hf))).logits


def site_module(model, site: str, layer: int):
    """The module whose output (or, for ``head``, input) is the site."""
    hf, a = model._module, adapter_for(model)
    block = _get(hf, a.blocks)[layer]
    if site == "resid":
        return block
    if site == "attn":
        return _get(block, a.attn)
    if site == "mlp":
        return _get(block, a.mlp)
    return _get(_get(block, a.attn), a.out_proj)  # head: z, the output projection's input


def record(model, site: str, input_ids) -> dict[int, torch.Tensor]:
    """Every layer's ``site`` value on one run."""
    a = adapter_for(model)
    store: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in range(a.n_layers):
        if site == "head":
            hooks.append((site_module(model, site, layer), "pre",
                          lambda m, args, i=layer: store.__setitem__(i, args[0].detach().clone())))
        else:
            hooks.append((site_module(model, site, layer), "post",
                          lambda m, args, out, i=layer: store.__setitem__(i, first(out).detach().clone())))
    hooked(hooks, lambda: logits_of(model, input_ids))
    return store


def patched_logits(model, site: str, layer: int, col: int, donor: torch.Tensor, base_ids, pos: int | None = None):
    """Logits of the ``base_ids`` run with ``donor``'s value written at one cell.

    ``col`` is the position, or for ``site="head"`` the head (written at ``pos``, or at every
    position when ``pos`` is None).
    """
    a = adapter_for(model)
    module = site_module(model, site, layer)
    if site == "head":
        cols = slice(col * a.head_dim, (col + 1) * a.head_dim)
        where = slice(None) if pos is None else pos

        def put_pre(m, args):
            z = args[0].clone()
            z[:, where, cols] = donor[:, where, cols]
            return (z,) + tuple(args[1:])
        return hooked([(module, "pre", put_pre)], lambda: logits_of(model, base_ids))

    def put(m, args, output):
        hidden = first(output).clone()  # clone: Falcon adds into its MLP output in place
        hidden[:, col] = donor[:, col]
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
    return hooked([(module, "post", put)], lambda: logits_of(model, base_ids))


def torch_patch(model, site: str, layer: int, pos: int, head: int | None, clean_ids, corrupt_ids):
    """Logits of the corrupt run with the clean value written at (layer, pos[, head])."""
    donor = record(model, site, clean_ids)[layer]
    return patched_logits(model, site, layer, pos if head is None else head, donor, corrupt_ids, pos=pos)


def patch_grid(model, site: str, clean_ids, corrupt_ids, answer: int, foil: int, positions=None,
               head_pos: int | None = None) -> torch.Tensor:
    """Denoising logit difference per (layer, position) — or (layer, head) for ``site="head"``,
    heads written at ``head_pos`` (all positions when None) — one forward per cell."""
    a = adapter_for(model)
    donor = record(model, site, clean_ids)
    T = clean_ids.shape[1]
    cols = range(a.n_heads) if site == "head" else [p % T for p in (positions or range(T))]
    grid = torch.zeros(a.n_layers, len(cols))
    for layer in range(a.n_layers):
        for j, col in enumerate(cols):
            logits = patched_logits(model, site, layer, col, donor[layer], corrupt_ids, pos=head_pos)
            grid[layer, j] = float(logits[0, -1, answer] - logits[0, -1, foil])
    return grid


def trace_grid(model, input_ids, subject: list[int], noise: torch.Tensor, answer: int) -> torch.Tensor:
    """ROME causal tracing of the residual stream: log P(answer) per (seed, layer, position).

    ``noise`` [seeds, len(subject), d_model] is added to the embedding output on the subject
    rows of every run of its seed; one clean block output is restored per forward.
    """
    hf, a = model._module, adapter_for(model)
    clean = record(model, "resid", input_ids)
    embed = _get(hf, a.embed)
    T = input_ids.shape[1]
    grid = torch.zeros(noise.shape[0], a.n_layers, T)
    for seed in range(noise.shape[0]):
        def corrupt(m, args, out, seed=seed):
            out = out.clone()
            out[:, subject] += noise[seed].to(out.device, out.dtype)
            return out
        for layer in range(a.n_layers):
            for pos in range(T):
                def restore(m, args, output, layer=layer, pos=pos):
                    hidden = first(output).clone()
                    hidden[:, pos] = clean[layer][:, pos]
                    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
                hooks = [(embed, "post", corrupt), (site_module(model, "resid", layer), "post", restore)]
                logits = hooked(hooks, lambda: logits_of(model, input_ids))
                grid[seed, layer, pos] = float(logits[0, -1].float().log_softmax(-1)[answer])
    return grid


def reference_path(model, *, base_text, donor_text, answer, foil, sender, receivers):
    """IOI-style path patching with torch hooks on the Hugging Face modules.

    Receivers' columns come from ``Adapter.qkv_columns`` (which the family tests check
    against what each head's attention does with them); the three runs are spelled out here.
    """
    hf, tok = model._module, model.tokenizer
    a = adapter_for(model)
    layers = _get(hf, a.blocks)
    hd = a.head_dim
    attn = [_get(layer, a.attn) for layer in layers]
    mlp = [_get(layer, a.mlp) for layer in layers]
    base_ids = tok(base_text, return_tensors="pt").input_ids
    donor_ids = tok(donor_text, return_tensors="pt").input_ids
    ans, f = tok(answer, add_special_tokens=False).input_ids[0], tok(foil, add_special_tokens=False).input_ids[0]

    def metric(logits):
        return float(logits[0, -1, ans] - logits[0, -1, f])

    def cache(ids):
        c = {"z": {}, "attn": {}, "mlp": {}}
        hooks = []
        for i in range(len(layers)):
            hooks.append((_get(attn[i], a.out_proj), "pre", lambda m, args, i=i: c["z"].__setitem__(i, args[0].clone())))
            hooks.append((attn[i], "post", lambda m, args, out, i=i: c["attn"].__setitem__(i, first(out).clone())))
            hooks.append((mlp[i], "post", lambda m, args, out, i=i: c["mlp"].__setitem__(i, first(out).clone())))
        return c, hooked(hooks, lambda: metric(logits_of(model, ids)))

    def replace(out, value):  # a fresh copy each time: Falcon adds into its MLP output in place
        return (value.clone(),) + tuple(out[1:]) if isinstance(out, tuple) else value.clone()

    base, _ = cache(base_ids)
    donor, _ = cache(donor_ids)
    kind, sl = sender[0], sender[1]

    hooks = []
    if kind == "head":
        h = sender[2]

        def swap_head(m, args):
            z = args[0].clone()
            z[:, :, h * hd:(h + 1) * hd] = donor["z"][sl][:, :, h * hd:(h + 1) * hd]
            return (z,) + tuple(args[1:])
        hooks.append((_get(attn[sl], a.out_proj), "pre", swap_head))
    for i in range(len(layers)):
        if i > sl:
            hooks.append((attn[i], "post", lambda m, args, out, i=i: replace(out, base["attn"][i])))
        if i > sl or (i == sl and kind == "head"):
            hooks.append((mlp[i], "post", lambda m, args, out, i=i: replace(out, base["mlp"][i])))
        if i == sl and kind == "mlp":
            hooks.append((mlp[i], "post", lambda m, args, out, i=i: replace(out, donor["mlp"][i])))

    def span(receiver):
        _, layer, head, which = receiver
        name, lo, hi = a.qkv_columns(which, head)
        return _get(attn[layer], name), slice(lo, hi)

    recorded = {}
    for n, receiver in enumerate(receivers):
        proj, cols = span(receiver)
        hooks.append((proj, "post", lambda m, args, out, n=n, cols=cols: recorded.__setitem__(n, out[:, :, cols].clone())))
    sender_metric = hooked(hooks, lambda: metric(logits_of(model, base_ids)))
    if not receivers:
        return sender_metric

    def put(n, cols):
        def hook(m, args, out):
            out = out.clone()
            out[:, :, cols] = recorded[n]
            return out
        return hook
    hooks = [(span(r)[0], "post", put(n, span(r)[1])) for n, r in enumerate(receivers)]
    return hooked(hooks, lambda: metric(logits_of(model, base_ids)))
