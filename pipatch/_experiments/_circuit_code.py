"""A circuit's part of ``Result.code()``'s script: ``circuit``, the EAP / EAP-IG edge scores
of :mod:`pipatch._experiments.circuits` written out with plain nnsight and torch, one receiver at
a time.

The graph is the protocol's. Senders: the embeddings, then each layer's heads and MLP.
Receivers: each layer's heads' query, key and value inputs (head by head) and its MLP's input,
then the logits. An edge exists where the sender writes to the residual stream before the
receiver reads it (the script's ``graph()``; in a parallel block, where attention and MLP read
the same residual, a layer's heads do not feed its MLP).

For each clean/corrupt pair the script

1. runs both prompts once, keeping the embedding outputs and every layer's ``z`` and MLP
   output;
2. computes each sender's write difference, clean minus corrupt, at every position
   (``sender_writes``). A head's is the attention's write with only that head's ``z`` swapped
   for the clean one, through the output projection (and the norm after the attention where the
   family has one), minus the corrupt run's write;
3. takes the metric's gradient at what each receiver reads and carries it back through the
   receiver's norm (and its own q/k/v columns) to the residual stream it reads from
   (``receiver_gradients``, ``pull_back``), at ``STEPS`` points on the line from the corrupt
   input embeddings to the clean ones, and averages them (EAP-IG; EAP is one point, the
   corrupt run). Gradients are taken at activations, never the weights;
4. scores every edge as write difference · gradient, summed over positions and width.

With grouped-query attention a key / value head is read by several query heads: each query
head's share of the gradient is a local backward from its own ``z`` columns through that
layer's attention. A dataset's pairs are averaged, scores and baselines alike. The grid holds
``corrupt metric + score`` (NaN where no edge exists) as normalized recovery.

:func:`circuit_code` raises :class:`~pipatch.PipatchError` in one line when the result's
module layout does not name the norms and q/k/v projections the receivers read, or its method
is not ``eap`` / ``eap-ig``.
"""

from __future__ import annotations

from string import Template
from typing import Any

from .._model.models import Adapter, PipatchError
from .._model.sites import HEAD, MLP, MLP_IN, Site, projection
from .._results import code as _code

__all__ = ["circuit_code", "circuit_inputs"]

_CIRCUIT = Template('''

STEPS = $steps  # $method: the gradients averaged over STEPS points from the corrupt input to the clean one (1: EAP)
PARALLEL = $parallel  # True: attention and MLP read the same residual, so a layer's heads do not feed its MLP
# COLUMNS[head]: [(projection, lo, hi) of its query, key, value], the output columns of
# projections(layer)[projection] that query head `head` reads; a key / value head is shared by
# GROUP query heads (grouped-query attention: each query head's share is kept apart).
COLUMNS = [
$columns
]
GROUP = $group
QKV = $qkv  # the projection module name(s) under the attention, as site() reads them
hf_layers = hf_model.$blocks  # the same blocks as torch modules, called outside any trace


def projections(layer):
    """Block `layer`'s query / key / value projection module(s) (torch modules)."""
    attn = hf_layers[layer].$attn
    return [$projections]


def attn_write(layer, z):
    """What the attention sublayer adds to the residual stream, from z [T, N_HEADS·HEAD_DIM]:
    $attn_doc."""
    out = first(hf_layers[layer].$out_proj(z))
$attn_return


def mlp_write(layer, out):
    """What the MLP sublayer adds to the residual stream, from the MLP's output [T, d]:
    $mlp_doc."""
$mlp_return


def token_id(answer):
    """An answer or foil as its token id: an id as given; text (a dataset's pairs) tokenized on its
    own, without special tokens, as it follows the prompt. This script reads one-token answers."""
    if answer is None or isinstance(answer, int):
        return answer
    ids = tokenizer(answer, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise SystemExit(f"this script reads one-token answers; {answer!r} is {len(ids)} tokens")
    return ids[0]


def graph():
    """edge[r, s]: whether sender s writes to the residual stream before receiver r reads it.
    Senders: the embeddings, then each layer's heads and MLP. Receivers: each layer's heads'
    query, key and value inputs (head by head) and its MLP's input, then the logits."""
    senders = [(-1, "emb")] + [(layer, kind) for layer in range(n_layers) for kind in ["head"] * N_HEADS + ["mlp"]]
    receivers = [(layer, kind) for layer in range(n_layers) for kind in ["qkv"] * (3 * N_HEADS) + ["mlp"]]
    receivers.append((n_layers, "logits"))
    return torch.tensor([[s < r or (s == r and s_kind == "head" and r_kind == "mlp" and not PARALLEL)
                          for s, s_kind in senders] for r, r_kind in receivers])


def sender_writes(clean, corrupt):
    """What each sender adds to the residual stream, clean minus corrupt, at every position:
    [senders, T, d]. A head's: the attention's write with only that head's z swapped for the
    clean one, minus the corrupt run's write."""
    writes = [clean["emb"][0].float() - corrupt["emb"][0].float()]
    for layer in range(n_layers):
        z_clean, z_corrupt = clean["z"][layer][0], corrupt["z"][layer][0]
        base = attn_write(layer, z_corrupt).float()
        for head in range(N_HEADS):
            cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
            z = z_corrupt.clone()
            z[:, cols] = z_clean[:, cols]
            writes.append(attn_write(layer, z).float() - base)
        writes.append(mlp_write(layer, clean["mlp"][layer][0]).float()
                      - mlp_write(layer, corrupt["mlp"][layer][0]).float())
    return torch.stack(writes)


def pull_back(norm, x, cotangent, projection=None):
    """d/dx of (cotangent · projection(norm(x))).sum() ([T, d]; no projection: norm(x) alone):
    a gradient at what a receiver reads, carried back to the residual stream x it reads it from,
    as if x fed that receiver alone."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        out = first(norm(x))
        if projection is not None:
            out = first(projection(out))
        (grad,) = torch.autograd.grad((out.float() * cotangent).sum(), x)
    return grad[0].float()


def zeros_for_none(grads, like):
    """torch.autograd.grad's results, a zero tensor where nothing reached a target (None)."""
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, like)]


def receiver_gradients(corrupt_ids, embedded, answer, foil):
    """The metric's gradient at the residual stream as each receiver alone reads it, [receivers, T, d]
    in the grid's order, from one run of the corrupt prompt on input embeddings `embedded` and one
    backward; and the metric. The gradients are taken at activations only, never the weights."""
    with torch.enable_grad(), model.trace(corrupt_ids, **LAST_ONLY):
        model.$embed.output = embedded.detach().clone().requires_grad_(True)
        acts = nnsight.save([])
        for layer in range(n_layers):
            x = layers[layer].$attn_norm.input  # the residual the heads read (through this norm)
            acts.append({
                "x": x,
                "qkv": [site(name, layer) for name in QKV],  # the q / k / v projections' outputs
                "z": site("head", layer),
                # the residual the MLP reads (through its norm): the block's input too where both read it
                "x_mid": x if PARALLEL else layers[layer].$mlp_norm.input,
                "mlp_in": site("mlp_in", layer),
            })
        x_final = model.$final_norm.input.save()  # the residual the logits read (through the final norm)
        y_final = first(model.$final_norm.output).save()
        value = metric(model.output.logits[0, -1], answer, foil).save()

    # The metric's gradient at every projection output, z, MLP input and the final norm's output.
    targets = [t for a in acts for t in (*a["qkv"], a["z"], a["mlp_in"])] + [y_final]
    found = zeros_for_none(torch.autograd.grad(value, targets, retain_graph=True, allow_unused=True), targets)
    per = len(acts[0]["qkv"]) + 2
    rows = []
    for layer, a in enumerate(acts):
        *g_qkv, g_z, g_mlp = found[layer * per : (layer + 1) * per]
        norm, modules = hf_layers[layer].$attn_norm, projections(layer)
        for head in range(N_HEADS):
            share = g_qkv
            if GROUP > 1:
                # A key / value head is read by GROUP query heads: head `head`'s own share is a
                # local backward from its z columns alone, through this layer's attention.
                cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                mask = torch.zeros_like(g_z)
                mask[..., cols] = g_z[..., cols]
                share = zeros_for_none(torch.autograd.grad(a["z"], a["qkv"], grad_outputs=mask, retain_graph=True,
                                                           allow_unused=True), a["qkv"])
            for i, lo, hi in COLUMNS[head]:  # its query, key, value: their own columns only
                cotangent = torch.zeros_like(g_qkv[i], dtype=torch.float)
                cotangent[..., lo:hi] = share[i][..., lo:hi]
                rows.append(pull_back(norm, a["x"], cotangent, modules[i]))
        rows.append(pull_back(hf_layers[layer].$mlp_norm, a["x_mid"], g_mlp.float()))
    rows.append(pull_back(hf_model.$final_norm, x_final, found[-1].float()))
    return torch.stack(rows), float(value)


def edge_scores(clean_prompt, corrupt_prompt, answer, foil):
    """EAP / EAP-IG of one pair: every edge's (clean − corrupt) sender write · the metric's gradient
    at the receiver, summed over positions and width, [receivers, senders]; clean and corrupt metric."""
    answer, foil = token_id(answer), token_id(foil)
    clean_ids, corrupt_ids = tokens(clean_prompt), tokens(corrupt_prompt)
    runs = {}
    for name, ids in (("clean", clean_ids), ("corrupt", corrupt_ids)):
        with model.trace(ids, **LAST_ONLY):
            acts = nnsight.save({"emb": model.$embed.output.clone(), "z": [], "mlp": []})
            for layer in range(n_layers):
                acts["z"].append(site("head", layer).clone())
                acts["mlp"].append(site("mlp", layer).clone())
            value = metric(model.output.logits[0, -1], answer, foil).save()
        runs[name] = (acts, float(value))
    (clean, clean_value), (corrupt, corrupt_value) = runs["clean"], runs["corrupt"]
    writes = sender_writes(clean, corrupt)

    # The gradients at STEPS points on the line from the corrupt input embeddings to the clean
    # ones (k / STEPS, k = 0 … STEPS − 1: the corrupt run first), averaged.
    total = 0
    for k in range(STEPS):
        point = corrupt["emb"] + (k / STEPS) * (clean["emb"] - corrupt["emb"])
        total = total + receiver_gradients(corrupt_ids, point, answer, foil)[0]
    grads = total / STEPS
    scores = torch.einsum("rtd,std->rs", grads.double(), writes.double())
    return scores.cpu(), clean_value, corrupt_value


def circuit(clean_prompt, corrupt_prompt, answer, foil):
    """Every edge's estimated change of the metric (EAP / EAP-IG), for one pair or for lists of
    pairs (a dataset: each edge's score, and the baselines, averaged over the pairs). Returns
    ({"edges": corrupt metric + score [1, receivers, senders], NaN where no edge exists},
    clean metric, corrupt metric [1])."""
    if isinstance(clean_prompt, str):
        clean_prompt, corrupt_prompt, answer, foil = [clean_prompt], [corrupt_prompt], [answer], [foil]
    total, cleans, corrupts = 0, [], []
    for pair in zip(clean_prompt, corrupt_prompt, answer, foil):
        scores, clean, corrupt = edge_scores(*pair)
        total = total + scores
        cleans.append(clean)
        corrupts.append(corrupt)
    scores = (total / len(cleans)).float()
    scores[~graph()] = float("nan")
    clean, corrupt = sum(cleans) / len(cleans), sum(corrupts) / len(corrupts)
    return {$view: (corrupt + scores).unsqueeze(0)}, torch.tensor(clean), torch.tensor([corrupt])
''')


def circuit_inputs(meta: dict) -> dict[str, Any]:
    """A circuit's inputs to the script's ``circuit`` function: one pair's prompts and the
    answer's and foil's ids, or a dataset's pairs (``meta["pairs"]``) as lists, their answers and
    foils as text (the result records their ids for the first pair only; the script tokenizes them)."""
    pairs = meta.get("pairs")
    if not pairs:
        return _code.pair_inputs(meta, positions=False)
    return {"clean_prompt": [p["clean"] for p in pairs], "corrupt_prompt": [p["corrupt"] for p in pairs],
            "answer": [p["answer"] for p in pairs], "foil": [p["foil"] for p in pairs]}


def circuit_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """A circuit's part of ``Result.code()``'s script (assembled by :func:`pipatch._results.code.script`):
    the name of the script's function, its code, the sites it reads (z, the MLP's output and
    input, the q/k/v projections) and a summary for the script's docstring. The scores are
    EAP / EAP-IG as :mod:`pipatch._programs._edges` defines them."""
    meta = result.meta
    norms = {what: getattr(adapter, what) for what in ("attn_norm", "mlp_norm", "final_norm")}
    if any(path is None for path in norms.values()) or adapter.qkv_layout is None or not adapter.qkv:
        raise PipatchError(f"code(): the result's module layout does not name the norms and q/k/v projections "
                           f"a circuit's receivers read ({adapter.family})")
    for what, path in norms.items():
        _code.dotted_path(path, what)
    post = {what: getattr(adapter, what) for what in ("attn_post_norm", "mlp_post_norm")}
    for what, path in post.items():
        if path is not None:
            _code.dotted_path(path, what)
    columns = []
    for head in range(adapter.n_heads):
        spans = []
        for which in "qkv":
            module, lo, hi = adapter.qkv_columns(which, head)
            spans.append((adapter.qkv.index(module), lo, hi))
        columns.append(f"    {spans!r},  # head {head}")
    attn_post, mlp_post = post["attn_post_norm"], post["mlp_post_norm"]
    method = str(meta.get("method", "eap-ig"))
    if method not in ("eap", "eap-ig"):
        raise PipatchError(f"code(): unknown circuit method {method!r}")
    code = _CIRCUIT.substitute(
        steps=int(meta.get("steps", 1)), method=method.upper(), parallel=bool(adapter.parallel),
        columns="\n".join(columns), group=adapter.n_heads // max(1, adapter.n_kv_heads), qkv=repr(list(adapter.qkv)),
        blocks=_code.dotted_path(adapter.blocks, "blocks"), attn=adapter.attn,
        projections=", ".join(f"attn.{name}" for name in adapter.qkv), out_proj=f"{adapter.attn}.{adapter.out_proj}",
        attn_doc=(f"its output projection, then {attn_post} (this family normalizes the attention's\n    output "
                  "before adding it)" if attn_post else "its output projection"),
        attn_return=f"    return hf_layers[layer].{attn_post}(out)" if attn_post else "    return out",
        mlp_doc=f"through {mlp_post}" if mlp_post else "that output as it is",
        mlp_return=f"    return hf_layers[layer].{mlp_post}(out)" if mlp_post else "    return out",
        embed=_code.dotted_path(adapter.embed, "embedding"), attn_norm=norms["attn_norm"], mlp_norm=norms["mlp_norm"],
        final_norm=norms["final_norm"], view=repr(result.views[0]),
    )
    pairs = int(meta.get("n_pairs", 1))
    summary = (f"{method.upper()} of every edge (sender write difference · the metric's gradient at the receiver"
               + (f", averaged over {int(meta.get('steps', 1))} points" if method == "eap-ig" else "") + ")"
               + (f", the mean over {pairs} pairs" if pairs > 1 else "") + ",\nas normalized recovery.")
    projections = [projection(module, order) for order, module in enumerate(adapter.qkv)]
    return "circuit", code, [HEAD, MLP, MLP_IN, *projections], summary
