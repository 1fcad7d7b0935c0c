"""The vocabulary shared by protocols, the engine and the backends: metrics, runs and cells.

A **cell** is one patched forward pass: a *base run* (a prompt, maybe under noise) with a list
of **ops** — write this value at that site, layer and index; or record what is there — and one
number read off its last position(s), the **metric** (a multi-token answer is read teacher-forced
over the positions after the prompt: :class:`Metric`). A protocol turns a researcher's question
into cells; the engine batches them; a backend runs a batch as invokes of one trace. Nothing
here touches a model.

Shapes: a site value is ``[batch, T, width]`` today (its dimensions are the site's:
:attr:`~pipatch._model.sites.Site.dims`); an op's ``index`` selects into one batch row's
value (``value[index]`` with the batch dimension kept, e.g. ``(slice(None), 4)`` for position
4, or ``(slice(None), [2, 3], slice(0, 64))`` for head 0's slice at positions 2 and 3). Indices
name prompt positions only: a run's value may be longer (the answer's tokens follow the prompt)
and have several batch rows (:attr:`Metric.n_inputs`), which a write covers alike.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .sites import Site

__all__ = ["METRICS", "Metric", "Capture", "Base", "Op", "Cell"]

METRICS = ("logit_diff", "prob", "logprob", "logprob_diff")


def _ids(value: int | Sequence[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


@dataclass(frozen=True)
class Metric:
    """A number read off the logits at the answer's positions: the metric of one run.

    ``answer`` (and ``foil``) are token ids: one token, or a sequence (" New York"). A
    multi-token answer is read **teacher-forced**: the run's input is the prompt followed by
    the answer's tokens but the last (:meth:`inputs`), and the answer's log-probability is the
    sum of its tokens' log-probabilities, each read at the position before it. So a run reads
    the logits at its last :attr:`n_read` positions (one for a one-token answer: the last
    prompt position, as always). Writes go to prompt positions only; the answer's positions
    are computed from them.

    * ``prob`` / ``logprob``: P(answer sequence) / its log.
    * ``logit``: the one-token answer's logit (a feature circuit on one prompt: the value
      attribution graphs explain, linear in what the last layer writes).
    * ``rank``: how many tokens the model ranks above the answer's (0: the answer is its top
      token); a multi-token answer's worst rank over its teacher-forced tokens, so 0 means
      greedy decoding writes the whole answer. It counts logits, so it reads them all
      (:attr:`needs_vocab`).
    * ``logit_diff``: answer − foil logits when both are one token (two rows of the
      unembedding suffice); otherwise the **log-probability difference** of the two sequences
      (:attr:`label` ``"logprob_diff"``). ``logprob_diff`` asks for that difference whatever
      the lengths (a dataset mixing one-token and multi-token answers). When the foil's tokens diverge from the answer's
      before its last token, the foil needs an input of its own: a run is then
      :attr:`n_inputs` sequences (prompt + each continuation, padded to one length).

    A backend hands :meth:`score` the logits of a batch of runs, ``[batch, n_inputs, n_read,
    vocab]``, or computes :meth:`pieces` of each input where the logits are (a vLLM worker)
    and combines them with :meth:`combine`.
    """

    name: str
    answer: tuple[int, ...]
    foil: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "answer", _ids(self.answer))
        object.__setattr__(self, "foil", _ids(self.foil))

    # -- what the metric reads ----------------------------------------------------------------
    @property
    def single(self) -> bool:
        """One-token answer (and foil): read at the last prompt position only."""
        return len(self.answer) == 1 and (self.foil is None or len(self.foil) == 1)

    @property
    def label(self) -> str:
        """The metric's name as results show it: ``logprob_diff`` for multi-token ``logit_diff``."""
        return "logprob_diff" if self.name == "logit_diff" and not self.single else self.name

    @property
    def is_difference(self) -> bool:
        """answer − foil (``logit_diff``, ``logprob_diff``), not a function of the answer alone."""
        return self.name in ("logit_diff", "logprob_diff")

    @property
    def sequences(self) -> list[tuple[int, ...]]:
        """The token sequences scored: the answer, then (``logit_diff``) the foil."""
        return [self.answer, self.foil] if self.is_difference else [self.answer]

    @property
    def n_read(self) -> int:
        """Positions read per input: the last ``n_read`` (the longest sequence's length)."""
        return max(len(s) for s in self.sequences)

    @property
    def continuations(self) -> list[tuple[int, ...]]:
        """Tokens appended to the prompt, one tuple per input, each ``n_read − 1`` long.

        A sequence ``s`` is read from the input whose continuation starts with ``s[:-1]``; the
        answer's continuation comes first, and a foil shares it when it can. Padding (the
        answer's first token, never read) makes every input the same length.
        """
        out: list[tuple[int, ...]] = []
        for seq in self.sequences:
            if not any(c[: len(seq) - 1] == seq[:-1] for c in out):
                out.append(seq[:-1])
        pad = self.n_read - 1
        return [c + (self.answer[0],) * (pad - len(c)) for c in out]

    @property
    def n_inputs(self) -> int:
        return len(self.continuations)

    def inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt ids [1, T] → the run's input ids [n_inputs, T + n_read − 1]."""
        conts = self.continuations
        if not conts[0]:
            return input_ids
        extra = torch.tensor(conts, dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids.expand(len(conts), -1), extra], dim=1)

    def _where(self) -> list[int]:
        """Which input each sequence is read from."""
        conts = self.continuations
        return [next(i for i, c in enumerate(conts) if c[: len(s) - 1] == s[:-1]) for s in self.sequences]

    @property
    def needs_vocab(self) -> bool:
        """The metric compares each read token's logit with every other (``rank``): no
        log-sum-exp shortcut, the backend hands :meth:`pieces` the whole vocabulary's logits."""
        return self.name == "rank"

    @property
    def token_ids(self) -> list[int] | None:
        """Vocabulary rows the metric reads, or ``None`` for all of them (a softmax needs all)."""
        if self.name == "logit" and len(self.answer) == 1:
            return [self.answer[0]]
        return [self.answer[0], self.foil[0]] if self.name == "logit_diff" and self.single else None

    @property
    def read_ids(self) -> list[int]:
        """Every vocabulary row whose logit the metric reads (each sequence's tokens), sorted:
        with the log-sum-exp of all the logits, all a softmax metric needs (:meth:`pieces`)."""
        return sorted({token for s in self.sequences for token in s})

    def _table(self) -> list[list[int]]:
        """Per read position ``j``, each sequence's token there (0 past its end, never read)."""
        return [[s[j] if j < len(s) else 0 for s in self.sequences] for j in range(self.n_read)]

    # -- reading it -------------------------------------------------------------------------
    def pieces(self, logits: torch.Tensor, index: int = 0, subset: bool = False,
               lse: torch.Tensor | None = None) -> torch.Tensor:
        """Input ``index``'s logits ``[..., n_read, vocab]`` → what :meth:`combine` needs of them,
        ``[..., n_read, n_sequences]``: per read position, each sequence's token log-probability
        (raw logits for a one-token ``logit_diff``; for ``rank``, how many logits exceed the
        token's; with ``subset`` the logits are already just :attr:`token_ids`' columns).

        With ``lse`` (``[..., n_read]``, the log-sum-exp of every logit at each position), the
        logits are just :attr:`read_ids`' columns: a token's log-probability is its logit minus
        ``lse``, so a backend need not hold the whole vocabulary's logits at once.
        """
        logits = logits.float()
        if subset:
            return logits
        table = self._table()
        if lse is not None:
            local = {token: i for i, token in enumerate(self.read_ids)}
            table = [[local.get(token, 0) for token in row] for row in table]
        table = torch.tensor(table, device=logits.device).expand(*logits.shape[:-1], len(self.sequences))
        if lse is not None:
            if self.needs_vocab:
                raise ValueError("a rank needs every logit, not their log-sum-exp")
            return logits.gather(-1, table) - lse.float()[..., None]
        if self.needs_vocab:
            chosen = logits.gather(-1, table)  # [..., n_read, n_sequences]
            return (logits[..., None, :] > chosen[..., None]).sum(-1).float()
        if self.token_ids is not None:
            return logits.gather(-1, table)
        # The log-sum-exp in float64: in float32 over a 262k vocabulary it is off by up to
        # 4e-5 (measured on vLLM's logits at P ≈ 0.5), the sliced one of the unembedding by 1e-6.
        wide = logits.double()
        return (wide.gather(-1, table) - torch.logsumexp(wide, dim=-1, keepdim=True)).float()

    def combine(self, pieces: torch.Tensor) -> torch.Tensor:
        """``[batch, n_inputs, n_read, n_sequences]`` pieces → the metric, [batch] float32."""
        if self.needs_vocab:  # the worst rank over the answer's tokens
            (seq,), (i,) = self.sequences, self._where()
            return pieces[:, i, : len(seq), 0].amax(-1)
        values = [pieces[:, i, : len(s), k].sum(-1) for k, (s, i) in enumerate(zip(self.sequences, self._where()))]
        if self.is_difference:
            return values[0] - values[1]
        return values[0].exp() if self.name == "prob" else values[0]

    def score(self, logits: torch.Tensor, subset: bool = False) -> torch.Tensor:
        """Logits ``[batch, n_inputs, n_read, vocab]`` (``[..., 2]`` with ``subset``) → [batch]."""
        return self.combine(self.pieces(logits, subset=subset))

    def answer_prob(self, logits: torch.Tensor) -> torch.Tensor:
        """P(answer sequence) from logits ``[batch, n_inputs, n_read, vocab]`` → [batch]."""
        logits = logits.float()
        if len(self.answer) == 1:
            return logits[:, 0, 0].softmax(-1)[:, self.answer[0]]
        rows = logits[:, self._where()[0], : len(self.answer)]
        ids = torch.tensor(self.answer, device=rows.device).expand(rows.shape[0], -1)
        return torch.log_softmax(rows, dim=-1).gather(-1, ids[..., None]).squeeze(-1).sum(-1).exp()


@dataclass
class Capture:
    """What one traced run (or a batch of ``n`` runs, e.g. one per noise seed) leaves behind.

    ``blocks[l]`` is block ``l``'s raw output (tensor or tuple) for the whole batch, as a
    backend must hand it back to skip the block: ``inputs`` rows per run (the metric's
    :attr:`~Metric.n_inputs`), at every position of the run's input. ``sites[name][l]`` is a
    site value at the prompt's positions, [n, T, width] (``"resid"`` always). ``metric`` and
    ``prob`` (of the answer; ``None`` where a backend did not read the softmax: a logit
    difference's run) are [n]; ``embedded`` is the embedding output, [n, T, d]. ``top1``
    (where the backend read the logits: a softmax metric) is each run's top next token after
    the prompt, [n] token ids: what a study's known-fact check reads off the clean run.
    ``keys`` (a backend that reuses prefixes) holds each layer's attention keys and values
    at the prompt's positions, ``(k, v)`` each [n, kv_heads, T, head_dim]: what a patched run
    that starts at a later position attends to for the positions before it. ``block_pairs``
    (the vLLM backend) says whether the model's blocks returned ``(hidden, residual)`` in
    this run, whose sum is the stream, rather than the stream: the structure a patched run
    that skips blocks hands the next one (``None``: not recorded, no skip).
    """

    blocks: list[Any]
    sites: dict[str, list[torch.Tensor]]
    metric: torch.Tensor
    embedded: torch.Tensor
    prob: torch.Tensor | None
    inputs: int = 1
    keys: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    top1: torch.Tensor | None = None
    block_pairs: bool | None = None

    def block_for(self, layer: int, row: int, start: int = 0) -> Any:
        """Block ``layer``'s output for run ``row`` only (its ``inputs`` batch rows), from
        position ``start`` on, in the block's own structure."""
        value = self.blocks[layer]
        lo, hi = row * self.inputs, (row + 1) * self.inputs
        if isinstance(value, tuple):
            hidden = value[0]
            return (hidden[lo:hi, start:],) + tuple(
                v[lo:hi, start:] if isinstance(v, torch.Tensor) and v.shape[:2] == hidden.shape[:2]
                else v[lo:hi] if isinstance(v, torch.Tensor) and v.shape[:1] == hidden.shape[:1] else v
                for v in value[1:]
            )
        return value[lo:hi, start:]

    def run(self, row: int) -> Capture:
        """Run ``row`` of this capture as a capture of its own (views, no copies)."""
        return Capture(
            blocks=[self.block_for(layer, row) for layer in range(len(self.blocks))],
            sites={name: [value[row : row + 1] for value in values] for name, values in self.sites.items()},
            metric=self.metric[row : row + 1], embedded=self.embedded[row : row + 1], prob=None if self.prob is None else self.prob[row : row + 1],
            inputs=self.inputs,
            keys=None if self.keys is None else [(k[row : row + 1], v[row : row + 1]) for k, v in self.keys],
            top1=None if self.top1 is None else self.top1[row : row + 1], block_pairs=self.block_pairs,
        )

    def site(self, name: str, layer: int, row: int) -> torch.Tensor | None:
        """Site ``name``'s value at ``layer`` for batch row ``row`` ([1, T, width]), if kept."""
        values = self.sites.get(name)
        return None if values is None else values[layer][row : row + 1]


@dataclass
class Base:
    """The run a cell patches: token ids [1, T], its capture, and the ops that made it.

    Row ``seed`` of ``capture`` is the base run of cells with that seed. ``ops[seed]`` (none by
    default) are the writes that run ``seed`` was captured under, which every cell of that
    seed runs under too, before its own: causal tracing's noise, one draw per seed added at the
    embedding (:data:`~pipatch._model.sites.EMBED`). They are the base run's, not the cell's: the
    engine never prunes or groups cells by them (:attr:`Cell.first_position` ignores them).
    """

    input_ids: torch.Tensor
    capture: Capture
    ops: list[list[Op]] = field(default_factory=list)

    @property
    def n_seeds(self) -> int:
        return int(self.capture.metric.shape[0])

    def ops_of(self, seed: int) -> list[Op]:
        """The base ops of run ``seed`` (empty where the base run has none)."""
        return self.ops[seed] if self.ops else []


@dataclass
class Op:
    """Write ``value`` at ``site[layer][index]``, or (``value is None``) record what is there.

    With ``add``, the value is added to what is there instead (in the site's dtype): causal
    tracing's noise at the embedding.
    """

    site: Site
    layer: int
    index: tuple
    value: torch.Tensor | None = None
    add: bool = False

    def apply(self, where: torch.Tensor, index: tuple | None = None) -> torch.Tensor | None:
        """Apply the op to ``where`` (one run's rows of the site's value) at ``index`` (its own
        by default; a backend passes a shifted one): write, add, or return a copy of what is
        there (a recording op)."""
        index = self.index if index is None else index
        if self.value is None:
            return where[index].clone()
        if self.add:
            where[index] += self.value.to(where.device, where.dtype)
        else:
            where[index] = self.value.to(where.device, where.dtype)
        return None

    def compact(self) -> Op:
        """The op with its value on the CPU in storage of its own, as it travels to another
        process (a donor slice is a view of its whole run's states, and a view pickles with
        all of its storage)."""
        if self.value is None:
            return self
        return dataclasses.replace(self, value=self.value.detach().cpu().clone())

    def from_position(self, start: int) -> Op | None:
        """The op with the positions before ``start`` dropped, for a run that starts at prompt
        position ``start`` (their states are the base run's, already under this op; the rest
        are then shifted by :meth:`index_from`), or ``None`` where none is left. Only an index
        that lists positions (a base op: the noised ones) can lose some; any other op is kept
        as is."""
        where = self.index[1] if len(self.index) > 1 else None
        if not start or not isinstance(where, (list, tuple)) or min(where) >= start:
            return self
        keep = [j for j, q in enumerate(where) if q >= start]
        if not keep:
            return None
        value = None if self.value is None else self.value[:, keep]
        index = (self.index[0], [int(where[j]) for j in keep], *self.index[2:])
        return dataclasses.replace(self, index=index, value=value)

    @property
    def key(self) -> tuple[int, int, str]:
        """Forward order: ops run sorted by this."""
        return (self.layer, self.site.order, self.site.name)

    @property
    def first_position(self) -> int:
        """The first prompt position the op touches: 0 when its index does not say (a mask,
        a negative position) — nothing before it can change, so a run may start there."""
        return self._bounds()[0]

    @property
    def last_position(self) -> int | None:
        """The last prompt position the op touches, or ``None`` when its index does not say
        (a mask, a negative position, a slice open at the end)."""
        return self._bounds()[1]

    def _bounds(self) -> tuple[int, int | None]:
        """(first, last) prompt positions of the index: (0, None) where it does not say."""
        dim = self.site.position_dim  # a site's positions need not be its second dimension
        at = self.index[dim] if len(self.index) > dim else None
        if isinstance(at, numbers.Integral):
            return (int(at), int(at)) if at >= 0 else (0, None)
        if isinstance(at, slice) and at.step in (None, 1):
            first = max(at.start or 0, 0)
            return first, (int(at.stop) - 1 if at.stop is not None and at.stop > first else None)
        if isinstance(at, (list, tuple)) and at and all(isinstance(i, numbers.Integral) for i in at):
            return (int(min(at)), int(max(at))) if min(at) >= 0 else (0, None)
        return 0, None

    def index_from(self, start: int) -> tuple:
        """``index`` for a run whose first position is prompt position ``start``
        (``start`` ≤ :attr:`first_position`)."""
        if not start:
            return self.index
        dim = self.site.position_dim
        at = self.index[dim]
        if isinstance(at, slice):
            at = slice(at.start - start, None if at.stop is None else at.stop - start)
        elif isinstance(at, numbers.Integral):
            at = int(at) - start
        else:
            at = [int(i) - start for i in at]
        return (*self.index[:dim], at, *self.index[dim + 1:])


@dataclass
class Cell:
    """One patched run of ``base`` (batch row ``seed``), filling grid cell ``(row, col)``.

    ``start`` is the first layer whose input can differ from the base run: blocks below it
    are the base run's, which a backend may reuse instead of recomputing. ``then``, when set,
    makes this a two-stage cell (path patching through q/k/v receivers): the ops' recorded
    values (in op order) are passed to ``then``, which returns the second stage's cell; its
    metric is this cell's value.
    """

    row: int
    col: int
    seed: int
    start: int
    ops: list[Op] = field(default_factory=list)
    then: Callable[[list[torch.Tensor]], Cell] | None = None

    def sorted_ops(self) -> list[Op]:
        return sorted(self.ops, key=lambda op: op.key)

    @property
    def first_position(self) -> int:
        """The first prompt position any op touches: the run's states before it are the base
        run's (attention is causal), so a backend may start the run there (prefix reuse)."""
        return min((op.first_position for op in self.ops), default=0)
