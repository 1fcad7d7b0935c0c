"""References written with plain PyTorch forward hooks, no nnsight: what pipatch must reproduce.

Each runs the Hugging Face module (``model._module``) directly, one forward per cell, the way
a researcher would write the loop by hand. Module *lookup* goes through pipatch's adapter (its
candidate names are what the family tests check); everything else is spelled out here.

* :func:`patch_grid` — activation patching, one (layer, position or head) cell per forward;
* :func:`trace_grid` — ROME causal tracing (noise on the subject's embeddings, one clean
  residual state restored per forward);
* :func:`reference_path` — IOI-style three-run path patching;
* :func:`reference_edge_scores` — a circuit's EAP / EAP-IG scores, one edge (and one backward) at
  a time; :func:`reference_edge_patch` — one exact edge patch.

All run on the CPU model they are given; the inputs are moved to its device.
"""

from __future__ import annotations

import torch

from pipatch._model.models import _get, adapter_for


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


def logits_of(model, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """The Hugging Face model's own logits of ``input_ids``; ``keep=n``: the last ``n``
    positions' alone (``[batch, n, vocab]``, the model's ``logits_to_keep``), for a reference
    that reads nothing else: the unembedding of the other positions (262k rows each on Gemma)
    was most of such a reference's arithmetic, and none of its result."""
    hf = model._module
    with torch.no_grad():
        if keep:
            return hf(input_ids.to(_device(hf)), logits_to_keep=keep).logits
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
    hooked(hooks, lambda: logits_of(model, input_ids, keep=1))
    return store


def patched_logits(model, site: str, layer: int, col: int, donor: torch.Tensor, base_ids, pos: int | None = None,
                   keep: int = 0):
    """Logits of the ``base_ids`` run with ``donor``'s value written at one cell (``keep``: the
    last ``keep`` positions' alone, :func:`logits_of`).

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
        return hooked([(module, "pre", put_pre)], lambda: logits_of(model, base_ids, keep))

    def put(m, args, output):
        hidden = first(output).clone()  # clone: Falcon adds into its MLP output in place
        hidden[:, col] = donor[:, col]
        return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
    return hooked([(module, "post", put)], lambda: logits_of(model, base_ids, keep))


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
            logits = patched_logits(model, site, layer, col, donor[layer], corrupt_ids, pos=head_pos, keep=1)
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
                logits = hooked(hooks, lambda: logits_of(model, input_ids, keep=1))
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


# --------------------------------------------------------------------------------------------
# Circuits: edge scores one edge at a time, and exact edge patches
# --------------------------------------------------------------------------------------------


class _Parts:
    """A model's modules and sizes for the circuit references (looked up through the adapter)."""

    def __init__(self, model):
        self.model, self.hf, self.tok = model, model._module, model.tokenizer
        a = self.a = adapter_for(model)
        self.layers = _get(self.hf, a.blocks)
        self.attn = [_get(layer, a.attn) for layer in self.layers]
        self.mlp = [_get(layer, a.mlp) for layer in self.layers]
        self.o = [_get(at, a.out_proj) for at in self.attn]
        self.attn_norm = [_get(layer, a.attn_norm) for layer in self.layers]
        self.mlp_norm = [_get(layer, a.mlp_norm) for layer in self.layers]
        self.attn_post = [_get(layer, a.attn_post_norm) if a.attn_post_norm else None for layer in self.layers]
        self.mlp_post = [_get(layer, a.mlp_post_norm) if a.mlp_post_norm else None for layer in self.layers]
        self.final = _get(self.hf, a.final_norm)
        self.embed = a.embedding(self.hf)
        self.group = a.n_heads // a.n_kv_heads

    def ids(self, text):
        return self.tok(text, return_tensors="pt").input_ids

    def token(self, text):
        return self.tok(text, add_special_tokens=False).input_ids[0]

    def cache(self, ids):
        """Every site of one plain run: embeddings, z, attention and MLP outputs, their writes."""
        c = {"emb": None, "z": {}, "attn": {}, "mlp": {}, "attn_write": {}, "mlp_write": {}}
        hooks = [(self.embed, "post", lambda m, args, out: c.__setitem__("emb", out.clone()))]
        for i in range(len(self.layers)):
            hooks.append((self.o[i], "pre", lambda m, args, i=i: c["z"].__setitem__(i, args[0].clone())))
            hooks.append((self.attn[i], "post", lambda m, args, out, i=i: c["attn"].__setitem__(i, first(out).clone())))
            hooks.append((self.mlp[i], "post", lambda m, args, out, i=i: c["mlp"].__setitem__(i, first(out).clone())))
            aw = self.attn_post[i] or self.attn[i]
            mw = self.mlp_post[i] or self.mlp[i]
            hooks.append((aw, "post", lambda m, args, out, i=i: c["attn_write"].__setitem__(i, first(out).clone())))
            hooks.append((mw, "post", lambda m, args, out, i=i: c["mlp_write"].__setitem__(i, first(out).clone())))
        hooked(hooks, lambda: self.hf(ids))
        return c

    def head_write(self, ids, layer, head, z_donor):
        """The attention write at ``layer`` with only ``head``'s z slice swapped for ``z_donor``'s."""
        hd, out = self.a.head_dim, {}

        def swap(m, args):
            z = args[0].clone()
            z[:, :, head * hd:(head + 1) * hd] = z_donor[:, :, head * hd:(head + 1) * hd]
            return (z,) + tuple(args[1:])
        aw = self.attn_post[layer] or self.attn[layer]
        hooked([(self.o[layer], "pre", swap), (aw, "post", lambda m, args, o: out.__setitem__("w", first(o).clone()))],
               lambda: self.hf(ids))
        return out["w"]


def reference_edge_scores(model, *, clean, corrupt, answer, foil, alphas=(0.0,)):
    """EAP / EAP-IG edge scores with plain hooks, one edge at a time: ``{(sender, receiver): score}``.

    Each edge's score is ``d/dε`` of the metric of a run whose receiver (alone) reads the
    residual plus ``ε ×`` the sender's write difference (clean − corrupt), at ε = 0, averaged
    over runs on input embeddings ``corrupt + α (clean − corrupt)``. A grouped-query key or
    value receiver: only its query head reads the perturbed keys / values (the group's other
    heads keep the unperturbed run's z)."""
    p = _Parts(model)
    a, L, H = p.a, p.a.n_layers, p.a.n_heads
    clean_ids, corrupt_ids = p.ids(clean), p.ids(corrupt)
    ans, fo = p.token(answer), p.token(foil)
    cc, kc = p.cache(clean_ids), p.cache(corrupt_ids)
    writes = {"emb": (cc["emb"] - kc["emb"])[0]}
    for layer in range(L):
        for head in range(H):
            writes[f"{layer}.{head}"] = (p.head_write(corrupt_ids, layer, head, cc["z"][layer]) - kc["attn_write"][layer])[0]
        writes[f"mlp{layer}"] = (cc["mlp_write"][layer] - kc["mlp_write"][layer])[0]

    def layer_of(name):
        return -1 if name == "emb" else int(name[3:]) if name.startswith("mlp") else int(name.split(".")[0])

    receivers = [f"{layer}.{h}.{w}" for layer in range(L) for h in range(H) for w in "qkv"]
    receivers = [r for layer in range(L) for r in [*(x for x in receivers if x.startswith(f"{layer}.")), f"mlp{layer}"]]
    receivers.append("logits")
    scores = {}
    for alpha in alphas:
        start = kc["emb"] + alpha * (cc["emb"] - kc["emb"])
        base_z = {}
        hooked([(p.embed, "post", lambda m, args, out: start.clone())]
               + [(p.o[i], "pre", lambda m, args, i=i: base_z.__setitem__(i, args[0].clone())) for i in range(L)],
               lambda: p.hf(corrupt_ids))
        for receiver in receivers:
            r_layer = L if receiver == "logits" else layer_of(receiver)
            for sender, delta in writes.items():
                s_layer = layer_of(sender)
                ok = s_layer < r_layer or (s_layer == r_layer and receiver.startswith("mlp") and "." in sender
                                           and not a.parallel)
                if not ok:
                    continue
                with torch.enable_grad():
                    eps = torch.zeros((), requires_grad=True)
                    hooks = [(p.embed, "post", lambda m, args, out: start.clone())]
                    hooks += _perturbed_receiver(p, receiver, eps * delta[None], base_z)
                    handles = [(m.register_forward_pre_hook(fn) if k == "pre" else m.register_forward_hook(fn))
                               for m, k, fn in hooks]
                    try:
                        logits = p.hf(corrupt_ids).logits
                    finally:
                        for h in handles:
                            h.remove()
                    value = logits[0, -1, ans] - logits[0, -1, fo]
                    (grad,) = torch.autograd.grad(value, eps)
                scores[(sender, receiver)] = scores.get((sender, receiver), 0.0) + float(grad) / len(alphas)
    return scores


def _perturbed_receiver(p, receiver, delta, base_z):
    """Hooks making ``receiver`` alone read its residual plus ``delta`` ([1, T, d])."""
    a, hd = p.a, p.a.head_dim
    busy = []
    if receiver == "logits":
        return [(p.final, "pre", lambda m, args: (args[0] + delta,) + tuple(args[1:]))]
    if receiver.startswith("mlp"):
        layer = int(receiver[3:])
        seen = {}

        def keep(m, args):
            if not busy:
                seen["x"] = args[0]

        def feed(m, args):
            busy.append(1)
            try:
                return (p.mlp_norm[layer](seen["x"] + delta),) + tuple(args[1:])
            finally:
                busy.pop()
        return [(p.mlp_norm[layer], "pre", keep), (p.mlp[layer], "pre", feed)]
    layer, head, which = receiver.split(".")
    layer, head = int(layer), int(head)
    name, lo, hi = a.qkv_columns(which, head)
    proj = _get(p.attn[layer], name)
    seen = {}

    def keep(m, args):
        if not busy:
            seen["x"] = args[0]

    def swap(m, args, out):
        if busy:
            return None
        busy.append(1)
        try:
            alt = first(m(p.attn_norm[layer](seen["x"] + delta)))
        finally:
            busy.pop()
        out = out.clone()
        out[:, :, lo:hi] = alt[:, :, lo:hi]
        return out
    hooks = [(p.attn_norm[layer], "pre", keep), (proj, "post", swap)]
    if which != "q" and p.group > 1:
        group = range(head // p.group * p.group, head // p.group * p.group + p.group)

        def others(m, args):
            z = args[0].clone()
            for h in group:
                if h != head:
                    z[:, :, h * hd:(h + 1) * hd] = base_z[layer][:, :, h * hd:(h + 1) * hd]
            return (z,) + tuple(args[1:])
        hooks.append((p.o[layer], "pre", others))
    return hooks


def reference_edge_patch(model, *, clean, corrupt, answer, foil, sender, receiver):
    """One exact edge patch (denoising: base corrupt, donor clean) with hooks: the metric.

    Run 2: the sender's clean value, every later attention / MLP output frozen to the corrupt
    run's, the receiver's input recorded; run 3: the corrupt run with only the receiver given
    that input (a grouped-query key / value: the group's other heads keep the corrupt z)."""
    p = _Parts(model)
    a, hd, L = p.a, p.a.head_dim, p.a.n_layers
    clean_ids, corrupt_ids = p.ids(clean), p.ids(corrupt)
    ans, fo = p.token(answer), p.token(foil)
    cc, kc = p.cache(clean_ids), p.cache(corrupt_ids)

    def metric(ids, hooks):
        logits = hooked(hooks, lambda: p.hf(ids).logits)
        return float(logits[0, -1, ans] - logits[0, -1, fo])

    def put(value):
        return lambda m, args, out: (value.clone(),) + tuple(out[1:]) if isinstance(out, tuple) else value.clone()

    s_layer = -1 if sender == "emb" else int(sender[3:]) if sender.startswith("mlp") else int(sender.split(".")[0])
    hooks = []
    if sender == "emb":
        hooks.append((p.embed, "post", put(cc["emb"])))
    elif sender.startswith("mlp"):
        hooks.append((p.mlp[s_layer], "post", put(cc["mlp"][s_layer])))
    else:
        s_head = int(sender.split(".")[1])

        def swap(m, args):
            z = args[0].clone()
            z[:, :, s_head * hd:(s_head + 1) * hd] = cc["z"][s_layer][:, :, s_head * hd:(s_head + 1) * hd]
            return (z,) + tuple(args[1:])
        hooks.append((p.o[s_layer], "pre", swap))
    for i in range(max(s_layer, 0), L):
        if i > s_layer:
            hooks.append((p.attn[i], "post", put(kc["attn"][i])))
        if not (i == s_layer and sender.startswith("mlp")):
            hooks.append((p.mlp[i], "post", put(kc["mlp"][i])))
    if receiver == "logits":
        return metric(corrupt_ids, hooks)
    recorded = {}
    if receiver.startswith("mlp"):
        layer = int(receiver[3:])
        hooks.append((p.mlp[layer], "pre", lambda m, args: recorded.__setitem__("x", args[0].clone())))
        metric(corrupt_ids, hooks)
        return metric(corrupt_ids, [(p.mlp[layer], "pre", lambda m, args: (recorded["x"].clone(),) + tuple(args[1:]))])
    layer, head, which = receiver.split(".")
    layer, head = int(layer), int(head)
    name, lo, hi = a.qkv_columns(which, head)
    proj = _get(p.attn[layer], name)
    hooks.append((proj, "post", lambda m, args, out: recorded.__setitem__("x", out[:, :, lo:hi].clone())))
    metric(corrupt_ids, hooks)

    def write(m, args, out):
        out = out.clone()
        out[:, :, lo:hi] = recorded["x"]
        return out
    hooks = [(proj, "post", write)]
    if which != "q" and p.group > 1:
        group = range(head // p.group * p.group, head // p.group * p.group + p.group)

        def others(m, args):
            z = args[0].clone()
            for h in group:
                if h != head:
                    z[:, :, h * hd:(h + 1) * hd] = kc["z"][layer][:, :, h * hd:(h + 1) * hd]
            return (z,) + tuple(args[1:])
        hooks.append((p.o[layer], "pre", others))
    return metric(corrupt_ids, hooks)


def reference_circuit_path(model, *, clean, corrupt, answer, foil, layer, head, which):
    """The metric of the two-edge circuit ``emb → layer.head.which → logits`` with hooks: the
    corrupt run where only that head's ``which`` input reads the residual plus the embeddings'
    change (clean − corrupt), and then the logits read the corrupt final residual plus that
    head's own change of the attention write; every other input stays the corrupt run's."""
    p = _Parts(model)
    clean_ids, corrupt_ids = p.ids(clean), p.ids(corrupt)
    ans, fo = p.token(answer), p.token(foil)
    cc, kc = p.cache(clean_ids), p.cache(corrupt_ids)
    delta = cc["emb"] - kc["emb"]
    seen = {}
    hooks = _perturbed_receiver(p, f"{layer}.{head}.{which}", delta, kc["z"])
    hooks.append((p.o[layer], "pre", lambda m, args: seen.__setitem__("z", args[0].clone())))
    hooked(hooks, lambda: p.hf(corrupt_ids))
    write = p.head_write(corrupt_ids, layer, head, seen["z"]) - kc["attn_write"][layer]
    logits = hooked([(p.final, "pre", lambda m, args: (args[0] + write,) + tuple(args[1:]))],
                    lambda: p.hf(corrupt_ids).logits)
    return float(logits[0, -1, ans] - logits[0, -1, fo])


def reference_mean_ablated(model, *, prompts, clean, answer, foil, emb_edge):
    """Mean ablation's circuit of no edge (``emb_edge=False``) or of the one edge emb → logits,
    with hooks: the logits read the final residual averaged, position by position, over
    ``prompts``, plus (with the edge) the clean embeddings less their mean over ``prompts``."""
    p = _Parts(model)
    finals, embs = [], []
    for text in prompts:
        seen = {}
        hooked([(p.final, "pre", lambda m, args: seen.__setitem__("x", args[0].clone())),
                (p.embed, "post", lambda m, args, out: seen.__setitem__("e", out.clone()))], lambda: p.hf(p.ids(text)))
        finals.append(seen["x"].double())
        embs.append(seen["e"].double())
    mean_final, mean_emb = torch.stack(finals).mean(0), torch.stack(embs).mean(0)
    seen = {}

    def read(m, args):
        x = mean_final + (seen["e"].double() - mean_emb if emb_edge else 0)
        return (x.to(args[0].dtype),) + tuple(args[1:])

    logits = hooked([(p.embed, "post", lambda m, args, out: seen.__setitem__("e", out.clone())), (p.final, "pre", read)],
                    lambda: p.hf(p.ids(clean)).logits)
    return float(logits[0, -1, p.token(answer)] - logits[0, -1, p.token(foil)])
