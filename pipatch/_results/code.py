"""``Result.code()``: the plain nnsight script that recomputes a result's grid, for a researcher to read.

pipatch batches cells, reuses cached blocks and unembeds one position; none of that changes a
number. The script written here does the same experiment the straightforward way, in the style
of a hand-written recipe — load the model with transformers, wrap it in nnsight, tokenize, run
the clean and corrupt baselines, then one patched run per cell (a row's cells batched as
invokes of one trace) — and writes ``{"grid": [[...], ...], "grids": {view: ...}}``, the same
quantity as ``result.grid`` / ``result.grids`` (normalized recovery, mean over seeds or
prompts), and what an experiment reports beside its grid (``EXTRA``: a feature patch's exact
checks, a feature read's latent ids). It imports torch, transformers and nnsight only, never pipatch.

What the script needs comes from ``result.meta`` alone, so a result read back with
:func:`pipatch.load_result` (or from ``to_json``) gives the same script:

* ``model_path`` and ``dtype``: what to load (the embedded default's converted folder, a local
  folder or a hub id); ``adapter``: where the family keeps its blocks, sublayers and heads;
* the experiment's inputs (prompts, answer / foil token ids, subject positions, noise scale,
  site, direction, positions, sender, receivers) and, for a dataset, each prompt's own
  (``meta["items"]``) and the columns of each named position.

A script has three parts, and :func:`script` puts them together:

1. the header every script shares: the imports, the model loaded and wrapped, and the helpers
   ``tokens``, ``first``, ``site`` (its body names only the sites the experiment reads),
   ``metric`` (the result's metric) and ``recovery``;
2. the experiment's own function, from its declaration's ``code`` (the template, and how the
   result's metadata fills it) and ``code_inputs`` (one example's inputs);
3. the run: one call of that function, or one per prompt of a dataset, and the grid written out.

Each experiment's template lives beside the protocol it writes out: causal tracing in
:mod:`pipatch._experiments.tracing`, activation patching in :mod:`~pipatch._experiments.patching`,
attribution patching in :mod:`~pipatch._experiments.attribution`, the logit lens in
:mod:`~pipatch._experiments.lens`, path patching in :mod:`~pipatch._experiments._paths_code`,
circuits in :mod:`~pipatch._experiments._circuit_code` and feature reads and patches (the SAE's
math spelled out, its weights read from the file it was loaded from) in
:mod:`~pipatch._experiments._feature_code`. This module keeps the header and the
assembly, and what several experiments share: :func:`pair_inputs` (a clean/corrupt pair's
inputs), :data:`PAIR_BASELINES` and :func:`pair_site` (patching's and attribution's clean run
and site) and :func:`dotted_path` (a module path from the metadata, checked before it becomes
code). It imports no protocol: a new experiment adds its template to its own module.

Every value from a user or a tokenizer enters the script through ``repr()`` (a Python literal),
never pasted into code: a prompt holding quotes, backslashes, newlines or ``\"\"\"`` is still a
valid script. Module paths from the metadata are checked to be dotted identifiers.

What cannot be written out raises :class:`~pipatch.PipatchError` in one line: a result of
another backend than transformers or NDIF (whose modules differ), one without the metadata the
script reads (saved by an older pipatch, or built by hand), a multi-token answer, or an
experiment without a template.
"""

from __future__ import annotations

import dataclasses
import re
from string import Template
from typing import Any

from .._model.declare import EXPERIMENTS, declared
from .._model.models import Adapter, PipatchError
from .._model.sites import RESID, Site
from .._model.sites import site as site_named

__all__ = ["script", "pair_inputs", "pair_site", "PAIR_BASELINES", "dotted_path"]

_IDENTIFIER_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

#: The metric of a result that reads values and scores nothing (a feature read's activations).
NO_METRIC = "activation"
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
EXTRA = {}  # what an experiment writes beside its grid (a feature patch: its exact checks)
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
$metric_part

def recovery(raw, clean, corrupt):
    """Normalized recovery (raw − corrupt) / (clean − corrupt) per seed, [seeds, layers, columns]:
    0 is the corrupt run, 1 the clean one; NaN where clean and corrupt (almost) agree."""
    clean, corrupt = clean.float().expand(corrupt.shape), corrupt.float()
    span = (clean - corrupt).reshape(-1, 1, 1)
    out = (raw - corrupt.reshape(-1, 1, 1)) / span
    undefined = span.abs() <= 1e-6 + 1e-3 * torch.maximum(clean.abs(), corrupt.abs()).reshape(-1, 1, 1)
    return torch.where(undefined, torch.tensor(float("nan")), out)
''')

_METRIC = Template('''

def metric(logits, answer, foil=None):
    """$metric_doc, from the last position's logits [vocab]."""
    $metric_body
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
    json.dump({"grid": as_json(grid), "grids": {view: as_json(g) for view, g in grids.items()}, **EXTRA}, handle)
print(grid)
''')

# --------------------------------------------------------------------------------------------
# Shared by the experiments on a clean/corrupt pair
# --------------------------------------------------------------------------------------------

#: The start of ``activation_patch`` and ``attribution``: the clean run, its metric and its
#: activations at SITE on every layer.
PAIR_BASELINES = '''\
    clean_ids, corrupt_ids = tokens(clean_prompt), tokens(corrupt_prompt)
    with model.trace(clean_ids, **LAST_ONLY):
        clean_acts = nnsight.save([site(SITE, layer).clone() for layer in range(n_layers)])
        clean = metric(model.output.logits[0, -1], answer, foil).save()
'''


def pair_site(result: Any) -> tuple[Site, bool, str, str]:
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


# --------------------------------------------------------------------------------------------
# Filling the templates
# --------------------------------------------------------------------------------------------


def dotted_path(value: Any, what: str) -> str:
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
        dotted_path(getattr(adapter, what), what)
    for name in adapter.qkv:
        dotted_path(name, "q/k/v projection")
    return dataclasses.replace(adapter, n_layers=int(adapter.n_layers), n_heads=int(adapter.n_heads),
                               n_kv_heads=int(adapter.n_kv_heads), head_dim=int(adapter.head_dim))


def _site_expression(adapter: Adapter, target: Site) -> str:
    """The script's expression for ``target``'s value at ``layer``, built from where the site
    says it lives: its module under the block, and whether it is that module's input or output."""
    path = target.module_path(adapter)
    module = f"layers[layer].{dotted_path(path, 'site')}" if path else "layers[layer]"
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


def _device_line(device: str) -> str:
    """Where the result ran; a CUDA device falls back to the CPU on a machine without one."""
    if device.startswith("cuda"):
        return f'DEVICE = {device!r} if torch.cuda.is_available() else "cpu"'
    return f"DEVICE = {device!r}"


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
    if result.metric == NO_METRIC:
        metric_part = ""
    elif result.metric in _METRIC_BODY:
        metric_part = _METRIC.substitute(metric_doc=_METRIC_DOC[result.metric], metric_body=_METRIC_BODY[result.metric])
    else:
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
        blocks=dotted_path(adapter.blocks, "blocks"), n_heads=adapter.n_heads, head_dim=adapter.head_dim,
        out_proj=f"{adapter.attn}.{adapter.out_proj}", site_lines=_site_lines(adapter, sites),
        metric_part=metric_part,
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
