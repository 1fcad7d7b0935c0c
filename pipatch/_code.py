"""``Result.code()``: the plain nnsight script that recomputes a result's grid, for a researcher to read.

pipatch batches cells, reuses cached blocks and unembeds one position; none of that changes a
number. The script written here does the same experiment the straightforward way, in the style
of a hand-written recipe — load the model with transformers, wrap it in nnsight, tokenize, run
the clean and corrupt baselines, then one patched run per cell (a row's cells batched as
invokes of one trace) — and writes ``{"grid": [[...], ...], "grids": {view: ...}}``, the same
quantity as ``result.grid`` / ``result.grids`` (normalized recovery, mean over seeds or
prompts). It imports torch, transformers and nnsight only, never pipatch.

What the script needs comes from ``result.meta`` alone, so a result read back with
:func:`pipatch.load_result` (or from ``to_json``) gives the same script:

* ``model_path`` and ``dtype``: what to load (the embedded default's converted folder, a local
  folder or a hub id); ``adapter``: where the family keeps its blocks, sublayers and heads;
* the experiment's inputs (prompts, answer / foil token ids, subject positions, noise scale,
  site, direction, positions, sender, receivers) and, for a dataset, each prompt's own
  (``meta["items"]``) and the columns of each named position.

Causal tracing's noise is drawn as pipatch draws it (:func:`pipatch._protocols.tracing.noise_draws`:
one ``torch.Generator().manual_seed(seed)`` per seed, ``randn × scale × σ``) with σ
recomputed from the clean run's embedding outputs on the subject, as pipatch measures it.

Every value from a user or a tokenizer enters the script through ``repr()`` (a Python literal),
never pasted into code: a prompt holding quotes, backslashes, newlines or ``\"\"\"`` is still a
valid script. Module paths from the metadata are checked to be dotted identifiers.
"""

from __future__ import annotations

import dataclasses
import re
from string import Template
from typing import Any

from ._declare import EXPERIMENTS, declared
from ._models import Adapter, PipatchError
from ._sites import ATTN, HEAD, MLP, MLP_IN, RESID, Site, projection
from ._sites import site as site_named

__all__ = ["script", "trace_code", "patch_code", "attribution_code", "path_code", "circuit_code", "trace_inputs",
           "pair_inputs", "circuit_inputs"]

_IDENTIFIER_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

_METRIC_DOC = {
    "prob": "P(answer) at the last position",
    "logprob": "log P(answer) at the last position",
    "logit_diff": "logit(answer) − logit(foil) at the last position",
    "logprob_diff": "log P(answer) − log P(foil) at the last position",
    "rank": "how many tokens rank above the answer at the last position (0: the top token)",
}
_METRIC_BODY = {
    "prob": "return logits.float().log_softmax(-1)[answer].exp()",
    "logprob": "return logits.float().log_softmax(-1)[answer]",
    "logit_diff": "logits = logits.float()\n    return logits[answer] - logits[foil]",
    "logprob_diff": "logprobs = logits.float().log_softmax(-1)\n    return logprobs[answer] - logprobs[foil]",
    "rank": "logits = logits.float()\n    return (logits > logits[answer]).sum().float()",
}

# --------------------------------------------------------------------------------------------
# The parts every script shares
# --------------------------------------------------------------------------------------------

_HEADER = Template('''\
"""$title

Recomputes this pipatch result's grid with nnsight and transformers only, the plain way:
$summary
Written by pipatch's Result.code(); pipatch itself is not needed.

    python this_script.py OUT.json    # writes {"grid": [[...], ...]}: rows are layers
"""
import json
import sys

import nnsight
import torch
from nnsight import TransformersModel
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = $model  # $label
$device_line
tokenizer = AutoTokenizer.from_pretrained(MODEL)
hf_model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.$dtype).to(DEVICE).eval()
model = TransformersModel(hf_model, tokenizer=tokenizer)
layers = model.$blocks
n_layers = len(layers)
N_HEADS, HEAD_DIM = $n_heads, $head_dim  # head h: the slice [h·HEAD_DIM, (h+1)·HEAD_DIM) of z, $out_proj's input
torch.set_grad_enabled(False)  # plain forward runs (attribution turns gradients on where it needs them)
# The metric reads the last position only: $last_only_doc
LAST_ONLY = $last_only


def tokens(text):
    """Token ids [1, T] of a prompt, as the model reads it."""
    return tokenizer(text, return_tensors="pt").input_ids.to(DEVICE)


def first(output):
    """The hidden states of a module's output: attention (and some blocks) return (hidden, extras...)."""
    return output[0] if isinstance(output, tuple) else output


def site(name, layer):
    """The activation called `name` at `layer`, [1, T, width], readable and writable inside a trace."""
$site_lines


def metric(logits, answer, foil=None):
    """$metric_doc, from the last position's logits [vocab]."""
    $metric_body


def recovery(raw, clean, corrupt):
    """Normalized recovery (raw − corrupt) / (clean − corrupt) per seed, [seeds, layers, columns]:
    0 is the corrupt run, 1 the clean one; NaN where clean and corrupt (almost) agree."""
    clean, corrupt = clean.float().expand(corrupt.shape), corrupt.float()
    span = (clean - corrupt).reshape(-1, 1, 1)
    out = (raw - corrupt.reshape(-1, 1, 1)) / span
    undefined = span.abs() <= 1e-6 + 1e-3 * torch.maximum(clean.abs(), corrupt.abs()).reshape(-1, 1, 1)
    return torch.where(undefined, torch.tensor(float("nan")), out)
''')

_SINGLE = Template('''

raw, clean, corrupt = $call
grids = {view: $values.nanmean(0) for view, values in raw.items()}
''')

_DATASET = Template('''

# One entry per prompt: its inputs, and which of its columns make each named position
# ($groups). Each prompt's columns are averaged within a named position, then each
# (prompt, seed) is normalized against its own baselines, and the grid is their mean.
DATASET = [
$entries
]


def named_positions(values, groups):
    """[seeds, layers, T] → [seeds, layers, named positions]: the mean over each one's columns."""
    nan = torch.full(values.shape[:2], float("nan"))
    return torch.stack([values[:, :, cols].mean(-1) if cols else nan for cols in groups], -1)


rows = {}
for inputs, groups in DATASET:
    raw, clean, corrupt = $function(**inputs)
    for view, values in raw.items():
        if groups is not None:
            values = named_positions(values, groups)
        rows.setdefault(view, []).append($values)
grids = {view: torch.cat(parts).nanmean(0) for view, parts in rows.items()}
''')

_FOOTER = Template('''
grid = grids[$view]


def as_json(t):
    return [[None if v != v else v for v in row] for row in t.tolist()]  # NaN → null


with open(sys.argv[1], "w") as handle:
    json.dump({"grid": as_json(grid), "grids": {view: as_json(g) for view, g in grids.items()}}, handle)
print(grid)
''')

# --------------------------------------------------------------------------------------------
# One experiment function each
# --------------------------------------------------------------------------------------------

_TRACE = Template('''

KINDS = $kinds  # in forward order: attention, MLP, then the block's output
WINDOW = $window  # layers restored together for the attn / mlp kinds (ROME's severed traces)
SEEDS = $seeds
CONTROL = $control  # True: restore from the corrupt run's own states (recovery must stay 0)


def causal_trace(prompt, subject, answer, scale):
    """ROME causal tracing of `prompt`: noise the `subject` token positions' embeddings, restore
    one clean state per (layer, position). Returns ({kind: metric [seeds, layers, T]}, clean
    metric, corrupt metric [seeds])."""
    input_ids = tokens(prompt)
    T = input_ids.shape[1]
    embed = model.$embed

    # 1. Clean run: every state a restoration writes back, and the embeddings the subject uses.
    with model.trace(input_ids, **LAST_ONLY):
        embedded = embed.output.clone().save()
        clean_states = nnsight.save({kind: [] for kind in KINDS})
        for layer in range(n_layers):
            for kind in KINDS:
                clean_states[kind].append(site(kind, layer).clone())
        clean = metric(model.output.logits[0, -1], answer).save()

    # 2. Noise of scale × σ on the subject's embedding outputs, σ their spread in the clean run;
    #    one seeded draw per seed, made once, so every restoration of a seed sees the same noise.
    sigma = float(embedded[0, subject].float().std())
    d_model = embedded.shape[-1]
    noise = [
        (torch.randn(len(subject), d_model, generator=torch.Generator().manual_seed(seed)) * (scale * sigma))
        .to(DEVICE)
        for seed in range(SEEDS)
    ]
    with model.trace(**LAST_ONLY) as tracer:
        corrupt = nnsight.save([])
        corrupt_states = nnsight.save([])
        for seed in range(SEEDS):
            with tracer.invoke(input_ids):
                embedded = embed.output
                embedded[:, subject] += noise[seed].to(embedded.dtype)
                states = {kind: [] for kind in KINDS}
                for layer in range(n_layers):
                    for kind in KINDS:
                        states[kind].append(site(kind, layer).clone())
                corrupt_states.append(states)
                corrupt.append(metric(model.output.logits[0, -1], answer))
    corrupt = torch.stack(list(corrupt))

    # 3. Restore: the noised run with one clean state (or a window of sublayer outputs) written
    #    back at one position; every (seed, position) of a layer as invokes of one trace.
    raw = {kind: torch.zeros(SEEDS, n_layers, T) for kind in KINDS}
    for kind in KINDS:
        for layer in range(n_layers):
            window = [layer] if kind == "resid" else range(layer, min(layer + WINDOW, n_layers))
            with model.trace(**LAST_ONLY) as tracer:
                row = nnsight.save([])
                for seed in range(SEEDS):
                    donor = corrupt_states[seed][kind] if CONTROL else clean_states[kind]
                    for pos in range(T):
                        with tracer.invoke(input_ids):
                            embedded = embed.output
                            embedded[:, subject] += noise[seed].to(embedded.dtype)
                            for w in window:
                                site(kind, w)[:, pos] = donor[w][:, pos]
                            row.append(metric(model.output.logits[0, -1], answer))
            raw[kind][:, layer] = torch.stack(list(row)).reshape(SEEDS, T)
    return raw, clean, corrupt
''')

_BASELINES = '''\
    clean_ids, corrupt_ids = tokens(clean_prompt), tokens(corrupt_prompt)
    with model.trace(clean_ids, **LAST_ONLY):
        clean_acts = nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)])
        clean = metric(model.output.logits[0, -1], answer, foil).save()
'''

_PATCH = Template('''

SITE = $site
DIRECTION = $direction


def activation_patch(clean_prompt, corrupt_prompt, answer, foil, positions$mean_arg):
    """Activation patching of SITE at every layer × $columns_doc.
    Returns ({SITE: metric [1, layers, columns]}, clean metric, corrupt metric [1])."""
$baselines\
    with model.trace(corrupt_ids, **LAST_ONLY):
        corrupt_acts = nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)])
        corrupt = metric(model.output.logits[0, -1], answer, foil).save()

$donor
    raw = torch.zeros(1, n_layers, $n_columns)
    for layer in range(n_layers):
        with model.trace(**LAST_ONLY) as tracer:
            row = nnsight.save([])
$cells
        raw[0, layer] = torch.stack(list(row))
    return {SITE: raw}, clean, corrupt.reshape(1)
''')

_DONORS = {
    "denoise": "    # denoise: run the corrupt prompt, paste in the clean activation (is the site sufficient?)\n"
               "    base_ids, donor = corrupt_ids, clean_acts\n",
    "noise": "    # noise: run the clean prompt, paste in the corrupt activation (is the site necessary?)\n"
             "    base_ids, donor = clean_ids, corrupt_acts\n",
    "zero": "    # zero ablation: run the clean prompt with the activation set to zeros\n"
            "    base_ids, donor = clean_ids, [torch.zeros_like(act) for act in clean_acts]\n",
    "mean": "    # mean ablation: run the clean prompt with the activation replaced by its mean over mean_prompts\n"
            "    runs = []\n"
            "    for text in mean_prompts:\n"
            "        with model.trace(tokens(text), **LAST_ONLY):\n"
            "            runs.append(nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)]))\n"
            "    donor = [torch.stack([run[layer][0] for run in runs]).mean(0, keepdim=True) for layer in range(n_layers)]\n"
            "    base_ids = clean_ids\n",
}

_POSITION_CELLS = '''\
            for pos in positions:
                with tracer.invoke(base_ids):
                    site(SITE, layer)[:, pos] = donor[layer][:, pos]
                    row.append(metric(model.output.logits[0, -1], answer, foil))'''

_HEAD_CELLS = '''\
            for head in range(N_HEADS):
                cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                with tracer.invoke(base_ids):
                    site(SITE, layer)[:, positions, cols] = donor[layer][:, positions, cols]
                    row.append(metric(model.output.logits[0, -1], answer, foil))'''

_ATTRIBUTE = Template('''

SITE = $site


def attribution(clean_prompt, corrupt_prompt, answer, foil, positions):
    """Attribution patching: every cell of a denoising grid estimated to first order,
    metric(clean act) − metric(corrupt act) ≈ grad · (clean − corrupt), the gradient taken once
    at the corrupt run. Two forwards and one backward. Returns ({SITE: corrupt metric +
    estimate [1, layers, columns]}, clean metric, corrupt metric [1])."""
$baselines\
    # The corrupt run with gradients. The embedding output becomes a leaf that needs a gradient
    # and the backward stops there: activations get gradients, the weights none.
    with torch.enable_grad(), model.trace(corrupt_ids, **LAST_ONLY):
        embed = model.$embed
        leaf = embed.output.detach().requires_grad_(True)
        embed.output = leaf
        acts = [site(SITE, layer) for layer in range(n_layers)]
        corrupt_acts = nnsight.save([act.detach().clone() for act in acts])
        value = metric(model.output.logits[0, -1], answer, foil)
        corrupt = value.detach().save()
        grads = nnsight.save([])
        with value.backward(inputs=[leaf]):
            for act in reversed(acts):  # nnsight serves gradients in reverse forward order
                grads.append(act.grad.detach().clone())
    grads = list(grads)[::-1]

    raw = torch.zeros(1, n_layers, $n_columns)
    for layer in range(n_layers):
        product = (grads[layer][0].float() * (clean_acts[layer][0].float() - corrupt_acts[layer][0].float()))[positions]
$estimate
    return {SITE: raw}, clean, corrupt.reshape(1)
''')

_PATH = Template('''

DIRECTION = $direction  # denoise: base run corrupt, donor clean; noise: the other way round
SENDER_LAYERS = $sender_layers  # grid rows
SENDER_HEADS = $sender_heads  # grid columns (None: the layer's MLP)
# Receivers by layer: (q/k/v projection under the attention, [(lo, hi) output columns]);
# empty: the direct path to the logits.
RECEIVERS = $receivers
FIRST_RECEIVER = min(RECEIVERS, default=n_layers)


def path_patch(clean_prompt, corrupt_prompt, answer, foil):
    """Path patching: each sender's effect on the metric through the receivers only.
    Returns ({view: metric [1, senders' layers, senders]}, clean metric, corrupt metric [1])."""
    runs = {}
    for name, text in (("clean", clean_prompt), ("corrupt", corrupt_prompt)):
        ids = tokens(text)
        with model.trace(ids, **LAST_ONLY):
            cache = nnsight.save({"z": [], "attn": [], "mlp": []})
            for layer in range(n_layers):
                cache["z"].append(site("head", layer).clone())
                cache["attn"].append(site("attn", layer).clone())
                cache["mlp"].append(site("mlp", layer).clone())
            value = metric(model.output.logits[0, -1], answer, foil).save()
        runs[name] = (ids, cache, value)
    base_ids, base, _ = runs["corrupt" if DIRECTION == "denoise" else "clean"]
    _, donor, _ = runs["clean" if DIRECTION == "denoise" else "corrupt"]

    raw = torch.full((1, len(SENDER_LAYERS), len(SENDER_HEADS)), float("nan"))
    for row, layer in enumerate(SENDER_LAYERS):
        if layer >= FIRST_RECEIVER:
            continue  # a receiver must read what the sender wrote: no path (NaN)
        # Run 2: the sender's output swapped for the donor's, every later attention and MLP
        # output frozen to the base run's; record what the receivers read.
        with model.trace(**LAST_ONLY) as tracer:
            values, recorded = nnsight.save([]), nnsight.save([])
            for head in SENDER_HEADS:
                with tracer.invoke(base_ids):
                    reads = []
                    for later in range(layer, n_layers):
                        for projection, spans in RECEIVERS.get(later, []):
                            out = site(projection, later)
                            reads += [out[:, :, lo:hi].clone() for lo, hi in spans]
                        if later == layer and head is not None:
                            cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                            site("head", layer)[:, :, cols] = donor["z"][layer][:, :, cols]
                        if later > layer:
                            site("attn", later)[:] = base["attn"][later]
                        sender_mlp = later == layer and head is None
                        site("mlp", later)[:] = (donor if sender_mlp else base)["mlp"][later]
                    recorded.append(reads)
                    values.append(metric(model.output.logits[0, -1], answer, foil))
        if RECEIVERS:
            # Run 3: the base run with only the receivers' inputs replaced by what run 2 recorded.
            with model.trace(**LAST_ONLY) as tracer:
                values = nnsight.save([])
                for reads in recorded:
                    with tracer.invoke(base_ids):
                        reads = iter(reads)
                        for later in sorted(RECEIVERS):
                            for projection, spans in RECEIVERS[later]:
                                out = site(projection, later)
                                for lo, hi in spans:
                                    out[:, :, lo:hi] = next(reads)
                        values.append(metric(model.output.logits[0, -1], answer, foil))
        raw[0, row] = torch.stack(list(values))
    return {$view: raw}, runs["clean"][2], runs["corrupt"][2].reshape(1)
''')

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


# --------------------------------------------------------------------------------------------
# Filling the templates
# --------------------------------------------------------------------------------------------


def _path(value: Any, what: str) -> str:
    """A module path from the metadata, checked to be dotted identifiers (it becomes code)."""
    if not isinstance(value, str) or not _IDENTIFIER_PATH.fullmatch(value):
        raise PipatchError(f"code(): the result's {what} module path {value!r} is not a dotted name")
    return value


def _adapter(meta: dict) -> Adapter:
    fields = meta.get("adapter")
    if not isinstance(fields, dict):
        raise PipatchError("code() needs the model's module layout (meta['adapter']), which this result does not "
                           "record (saved by an older pipatch): rerun the experiment")
    try:
        adapter = Adapter(**{**fields, "qkv": tuple(fields.get("qkv") or ())})
    except TypeError as error:
        raise PipatchError(f"code(): meta['adapter'] is not a module layout pipatch knows ({error})") from None
    for what in ("embed", "blocks", "attn", "mlp", "out_proj", "unembed"):
        _path(getattr(adapter, what), what)
    for name in adapter.qkv:
        _path(name, "q/k/v projection")
    return dataclasses.replace(adapter, n_layers=int(adapter.n_layers), n_heads=int(adapter.n_heads),
                               n_kv_heads=int(adapter.n_kv_heads), head_dim=int(adapter.head_dim))


def _site_expression(adapter: Adapter, target: Site) -> str:
    """The script's expression for ``target``'s value at ``layer``, built from where the site
    says it lives: its module under the block, and whether it is that module's input or output."""
    path = target.module_path(adapter)
    module = f"layers[layer].{_path(path, 'site')}" if path else "layers[layer]"
    return f"{module}.input" if target.reads_input else f"first({module}.output)"


def _site_lines(adapter: Adapter, sites: list[Site]) -> str:
    """The body of the script's ``site(name, layer)`` for the sites it uses."""
    lines = [f"    if name == {s.name!r}:  # {s.about}\n        return {_site_expression(adapter, s)}" for s in sites]
    return "\n".join(lines) + "\n    raise ValueError(name)"


def _call(callee: str, inputs: dict[str, Any], notes: dict[str, str], indent: str = "") -> str:
    """``callee(key=<repr>, ...)``, one key per line, each value a Python literal (``repr``) and
    ``notes[key]`` as a comment (``repr`` too: never a line break)."""
    body = "".join(f"{indent}    {key}={value!r},{f'  # {notes[key]!r}' if key in notes else ''}\n"
                   for key, value in inputs.items())
    return f"{callee}(\n{body}{indent})"


def trace_inputs(meta: dict) -> dict[str, Any]:
    """One causal trace's inputs to the script's ``causal_trace`` function."""
    return {"prompt": meta["prompt"], "subject": list(meta["subject_positions"]), "answer": int(meta["answer_id"]),
            "scale": float(meta["scale"])}


def pair_inputs(meta: dict, *, positions: bool = True, means: bool = False) -> dict[str, Any]:
    """One clean/corrupt pair's inputs to the script's function: the prompts, the answer's and
    foil's ids, and (``positions``) the swept positions, (``means``) a mean ablation's prompts."""
    inputs = {"clean_prompt": meta["clean_prompt"], "corrupt_prompt": meta["corrupt_prompt"],
              "answer": int(meta["answer_id"]), "foil": None if meta.get("foil_id") is None else int(meta["foil_id"])}
    if positions:
        inputs["positions"] = list(meta["positions"])
    if means and meta.get("direction") == "mean":
        inputs["mean_prompts"] = list(meta.get("mean_prompts") or [meta["clean_prompt"], meta["corrupt_prompt"]])
    return inputs


def trace_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Causal tracing's part of the script: (function name, its code, the sites it reads, a summary)."""
    meta = result.meta
    # In forward order (attention, MLP, then the block's output), as the script's KINDS say.
    traced = sorted((site_named(name) for name in meta.get("kinds") or result.views), key=lambda s: s.order)
    code = _TRACE.substitute(kinds=repr([s.name for s in traced]), window=int(meta["window"]),
                             seeds=int(meta["seeds"]), control=bool(meta.get("control")),
                             embed=_path(adapter.embed, "embedding"))
    summary = (f"noise the subject's embeddings ({int(meta['seeds'])} seeded draws), restore one clean state per\n"
               "(layer, position), average normalized recovery over the seeds.")
    return "causal_trace", code, traced, summary


def _pair_site(result: Any) -> tuple[Site, bool, str, str]:
    """A pair experiment's site (``meta["site"]``), whether its columns are heads, and the
    script's column words."""
    name = result.meta.get("site", RESID.name)
    try:
        target = site_named(name)
    except PipatchError:
        raise PipatchError(f"code(): unknown site {name!r}") from None
    heads = target.per_head
    n_columns = "N_HEADS" if heads else "len(positions)"
    columns_doc = "head (each patched at `positions`)" if heads else "position in `positions`"
    return target, heads, n_columns, columns_doc


def patch_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Activation patching's part of the script (see :func:`trace_code`)."""
    target, heads, n_columns, columns_doc = _pair_site(result)
    direction = result.meta.get("direction", "denoise")
    if direction not in _DONORS:
        raise PipatchError(f"code(): unknown patching direction {direction!r}")
    code = _PATCH.substitute(site=repr(target.name), direction=repr(direction), columns_doc=columns_doc,
                             mean_arg=", mean_prompts" if direction == "mean" else "",
                             baselines=_BASELINES, donor=_DONORS[direction], n_columns=n_columns,
                             cells=_HEAD_CELLS if heads else _POSITION_CELLS)
    summary = (f"clean and corrupt runs, then one {direction} patch of the {target.name} site per cell, normalized\n"
               "recovery (patched − corrupt) / (clean − corrupt).")
    return "activation_patch", code, [target], summary


def attribution_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Attribution patching's part of the script (see :func:`trace_code`)."""
    target, heads, n_columns, _ = _pair_site(result)
    estimate = ("        raw[0, layer] = corrupt + product.reshape(len(positions), N_HEADS, HEAD_DIM).sum(dim=(0, 2))"
                if heads else "        raw[0, layer] = corrupt + product.sum(-1)")
    code = _ATTRIBUTE.substitute(site=repr(target.name), baselines=_BASELINES, n_columns=n_columns,
                                 embed=_path(adapter.embed, "embedding"), estimate=estimate)
    summary = ("attribution patching, gradient × (clean − corrupt) activation at every cell from two\n"
               "forwards and one backward, as normalized recovery.")
    return "attribution", code, [target], summary


def path_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """Path patching's part of the script (see :func:`trace_code`)."""
    meta = result.meta
    code = _PATH.substitute(direction=repr(meta.get("direction", "denoise")),
                            sender_layers=repr([int(x) for x in result.layers]),
                            sender_heads=repr(_sender_heads(result)), receivers=_receivers(meta, adapter),
                            view=repr(result.views[0]))
    summary = ("path patching, one run per sender with every later attention and MLP output frozen\n"
               "(and one more writing only the receivers' inputs), as normalized recovery.")
    projections = [projection(module, order) for order, module in enumerate(adapter.qkv)]
    return "path_patch", code, [HEAD, ATTN, MLP, *projections], summary


def circuit_inputs(meta: dict) -> dict[str, Any]:
    """A circuit's inputs to the script's ``circuit`` function: one pair's prompts and the
    answer's and foil's ids, or a dataset's pairs (``meta["pairs"]``) as lists, their answers and
    foils as text (the result records their ids for the first pair only; the script tokenizes them)."""
    pairs = meta.get("pairs")
    if not pairs:
        return pair_inputs(meta, positions=False)
    return {"clean_prompt": [p["clean"] for p in pairs], "corrupt_prompt": [p["corrupt"] for p in pairs],
            "answer": [p["answer"] for p in pairs], "foil": [p["foil"] for p in pairs]}


def circuit_code(result: Any, adapter: Adapter) -> tuple[str, str, list[Site], str]:
    """A circuit's part of the script (see :func:`trace_code`): EAP / EAP-IG as
    :mod:`pipatch._backends._edges` defines it, written out one receiver at a time."""
    meta = result.meta
    norms = {what: getattr(adapter, what) for what in ("attn_norm", "mlp_norm", "final_norm")}
    if any(path is None for path in norms.values()) or adapter.qkv_layout is None or not adapter.qkv:
        raise PipatchError(f"code(): the result's module layout does not name the norms and q/k/v projections "
                           f"a circuit's receivers read ({adapter.family})")
    for what, path in norms.items():
        _path(path, what)
    post = {what: getattr(adapter, what) for what in ("attn_post_norm", "mlp_post_norm")}
    for what, path in post.items():
        if path is not None:
            _path(path, what)
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
        blocks=_path(adapter.blocks, "blocks"), attn=adapter.attn,
        projections=", ".join(f"attn.{name}" for name in adapter.qkv), out_proj=f"{adapter.attn}.{adapter.out_proj}",
        attn_doc=(f"its output projection, then {attn_post} (this family normalizes the attention's\n    output "
                  "before adding it)" if attn_post else "its output projection"),
        attn_return=f"    return hf_layers[layer].{attn_post}(out)" if attn_post else "    return out",
        mlp_doc=f"through {mlp_post}" if mlp_post else "that output as it is",
        mlp_return=f"    return hf_layers[layer].{mlp_post}(out)" if mlp_post else "    return out",
        embed=_path(adapter.embed, "embedding"), attn_norm=norms["attn_norm"], mlp_norm=norms["mlp_norm"],
        final_norm=norms["final_norm"], view=repr(result.views[0]),
    )
    pairs = int(meta.get("n_pairs", 1))
    summary = (f"{method.upper()} of every edge (sender write difference · the metric's gradient at the receiver"
               + (f", averaged over {int(meta.get('steps', 1))} points" if method == "eap-ig" else "") + ")"
               + (f", the mean over {pairs} pairs" if pairs > 1 else "") + ",\nas normalized recovery.")
    projections = [projection(module, order) for order, module in enumerate(adapter.qkv)]
    return "circuit", code, [HEAD, MLP, MLP_IN, *projections], summary


def _device_line(device: str) -> str:
    """Where the result ran; a CUDA device falls back to the CPU on a machine without one."""
    if device.startswith("cuda"):
        return f'DEVICE = {device!r} if torch.cuda.is_available() else "cpu"'
    return f"DEVICE = {device!r}"


def _sender_heads(result: Any) -> list[int | None]:
    if result.col_axis == "component":
        return [None]
    return [int(label[1:]) for label in result.columns]  # "H3" → 3


def _receivers(meta: dict, adapter: Adapter) -> str:
    """``{layer: [(projection, [(lo, hi), ...]), ...]}`` in forward order, as a literal."""
    receivers = meta.get("receivers", "logits")
    if isinstance(receivers, str) or not receivers:  # the direct path, to the logits
        return "{}"
    by_layer: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for _, layer, head, which in receivers:
        module, lo, hi = adapter.qkv_columns(which, int(head))
        by_layer.setdefault(int(layer), {}).setdefault(module, []).append((lo, hi))
    order = {name: i for i, name in enumerate(adapter.qkv)}
    return repr({layer: sorted(modules.items(), key=lambda item: order[item[0]])
                 for layer, modules in sorted(by_layer.items())})


def _inputs_of(declaration: Any, meta: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """One example's inputs to the script's experiment function, and the text behind its token ids."""
    inputs = declaration.code_inputs(meta)
    # A dataset's lists of answers carry their text already: no note of the first pair's.
    notes = {key: meta.get(key) for key in ("answer", "foil") if not isinstance(inputs.get(key), list)}
    if "subject" in inputs and isinstance(meta.get("subject"), str):
        notes["subject"] = meta["subject"]
    return inputs, {key: str(text) for key, text in notes.items() if text is not None}


def script(result: Any) -> str:
    """The script of :meth:`pipatch.Result.code` (see the module docstring)."""
    try:
        return _script(result)
    except KeyError as missing:
        raise PipatchError(f"code() needs meta[{missing}], which this result does not record (saved by an older "
                           "pipatch, or built by hand): rerun the experiment") from None
    except (TypeError, ValueError) as error:
        raise PipatchError(f"code(): this result's metadata is not what pipatch records ({error})") from None


def _script(result: Any) -> str:
    meta = result.meta
    if meta.get("backend", "transformers") not in ("transformers", "ndif"):  # NDIF runs transformers modules
        raise PipatchError(f"code() writes transformers code; this result ran on the {meta.get('backend')} "
                           "backend, whose modules differ: rerun it with backend='transformers'")
    if not meta.get("model_path"):
        raise PipatchError("code() needs the folder or hub id the model was loaded from (meta['model_path']), "
                           "which this result does not record (saved by an older pipatch): rerun the experiment")
    for entry in [meta, *(meta.get("items") or [])]:
        for role in ("answer", "foil"):
            ids = entry.get(f"{role}_ids")
            if ids is not None and len(ids) > 1:
                raise PipatchError(f"code() writes scripts for one-token answers; this result's {role} "
                                   f"{entry.get(role)!r} is {len(ids)} tokens (read teacher-forced): use result.grid, "
                                   "or rerun with a one-token answer for the script")
    declaration = declared(result.kind)
    if declaration is None or declaration.code is None or declaration.code_inputs is None:
        known = ", ".join(sorted(e.kind for e in EXPERIMENTS.values() if e.code is not None))
        raise PipatchError(f"code() cannot write a script for a {result.kind!r} result: it covers {known} results")
    adapter = _adapter(meta)
    function, experiment, sites, summary = declaration.code(result, adapter)
    if result.metric not in _METRIC_BODY:
        raise PipatchError(f"code(): unknown metric {result.metric!r}")
    device = str(meta.get("device", "cpu"))
    dtype = str(meta.get("dtype", "float32"))
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise PipatchError(f"code(): the result's dtype {dtype!r} is not a floating-point torch dtype")
    header = _HEADER.substitute(
        title=_docstring_line(result.title), summary=summary, model=repr(str(meta["model_path"])),
        label=repr(str(meta.get("model", ""))), device_line=_device_line(device), dtype=dtype,
        last_only=repr({"logits_to_keep": 1} if adapter.last_logits_only else {}),
        last_only_doc=("with logits_to_keep=1 the unembedding runs there alone." if adapter.last_logits_only
                       else "this model's forward cannot skip the other positions."),
        blocks=_path(adapter.blocks, "blocks"), n_heads=adapter.n_heads, head_dim=adapter.head_dim,
        out_proj=f"{adapter.attn}.{adapter.out_proj}", site_lines=_site_lines(adapter, sites),
        metric_doc=_METRIC_DOC[result.metric], metric_body=_METRIC_BODY[result.metric],
    )
    # A normalized result's grid is recovery against its baselines; the logit lens's, the metric.
    values = "recovery(values, clean, corrupt)" if result.normalized else "values"
    if meta.get("dataset"):
        entries = []
        for item in meta.get("items") or []:
            groups = item.get("group_columns")
            entries.append(f"    ({_call('dict', *_inputs_of(declaration, item), '    ')}, {groups!r}),")
        if not entries:
            raise PipatchError("code() needs each prompt's inputs (meta['items']), which this dataset result does not "
                               "record (saved by an older pipatch): rerun the experiment")
        run = _DATASET.substitute(entries="\n".join(entries), function=function, values=values,
                                  groups=repr(list(result.columns)) if result.col_axis == "token" else "none")
    else:
        run = _SINGLE.substitute(call=_call(function, *_inputs_of(declaration, meta)), values=values)
    return header + experiment + run + _FOOTER.substitute(view=repr(result.views[0]))


def _docstring_line(text: str) -> str:
    """``text`` safe inside a triple-quoted docstring: its repr without the quotes, on one line."""
    return repr(text)[1:-1].replace('"""', '\\"\\"\\"')
