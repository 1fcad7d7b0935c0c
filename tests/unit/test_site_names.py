"""Sites own their semantics: no module but ``pipatch/_model/sites.py`` compares site names.

What a site *is* (its module, its column axis, where a run that writes it starts, how an index
into it reads) lives on :class:`pipatch._model.sites.Site`. Code elsewhere that asks ``site ==
"head"`` or ``site.where == "block"`` re-decides it, and a new site (an attention pattern) then
silently takes the wrong branch. This test greps every other module for such comparisons and
fails listing ``file:line`` of each.

The grep runs over each *logical line's tokens*, not the raw text: comments are dropped and
every string literal that is not exactly a site name is blanked, so prose and the code
templates of ``Result.code()`` (whose generated scripts may compare what they like) are not
read as code, ``direction == "mean"`` or ``metric == "prob"`` never match, and a comparison
split over lines still does. What it flags:

* a site-name literal on either side of ``==`` / ``!=``, after ``case``, or in an ``in`` /
  ``not in`` test (``site in ("resid", "mlp")``, ``"head" in kinds``);
* ``.where`` / ``.holder`` (which module holds a site) compared to anything;
* a site's ``.name`` compared to anything (``view == HEAD.name``, ``op.site.name != x``);
* a lookup in the table of sites by hand (``name in SITES``) instead of :func:`pipatch._model.sites.site`.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipatch"

#: Site names and the names of the modules that hold them (``Site.holder``).
SITE_NAMES = ("resid", "attn", "mlp", "head", "q", "k", "v", "block", "out_proj", "proj")

_LITERAL = r"""(?:'(?:{0})'|"(?:{0})")""".format("|".join(SITE_NAMES))
_SITE_OBJECT = r"(?:\b(?:RESID|ATTN|MLP|HEAD|target)|\w*site\w*)"
_PATTERNS = [
    rf"(?:==|!=)\s*{_LITERAL}",  # x == "head"
    rf"{_LITERAL}\s*(?:==|!=)",  # "head" == x
    rf"\bcase\s*{_LITERAL}",  # match / case "head":
    rf"{_LITERAL}\s*(?:not\s+)?in\b",  # "head" in kinds
    rf"\bin\s*[(\[{{][^()\[\]{{}}]*{_LITERAL}",  # x in ("resid", "mlp")
    r"\.(?:where|holder)\s*(?:==|!=|(?:not\s+)?in\b)",  # site.where == ..., site.holder in ...
    r"(?:==|!=|\bin)\s*[\w.]*\.(?:where|holder)\b",  # ... == site.where
    rf"{_SITE_OBJECT}\.name\s*(?:==|!=)",  # op.site.name == ..., HEAD.name != ... (a lookup by it is fine)
    rf"(?:==|!=)\s*{_SITE_OBJECT}\.name\b",  # view == HEAD.name
    r"\bin\s+(?:_sites\.)?SITES\b",  # name in SITES
]
SITE_COMPARISON = re.compile("|".join(f"(?:{p})" for p in _PATTERNS))


def _logical_lines(source: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each logical line as its tokens joined up, with ``(offset, line number)`` of each token:
    comments dropped, a string literal kept only when it is exactly a site name."""
    lines: list[tuple[str, list[tuple[int, int]]]] = []
    text, where = "", []
    site_literals = {repr(name) for name in SITE_NAMES} | {f'"{name}"' for name in SITE_NAMES}
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    fstring_parts = {getattr(tokenize, name) for name in ("FSTRING_MIDDLE", "TSTRING_MIDDLE") if hasattr(tokenize, name)}
    depth, loops = 0, []  # bracket depth; the depths of ``for``s still waiting for their ``in``
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if text:
                lines.append((text, where))
            text, where, depth, loops = "", [], 0, []
            continue
        if token.type in skip:
            continue
        piece = token.string
        if token.type == tokenize.STRING and piece not in site_literals:
            piece = '""'
        elif token.type in fstring_parts:
            piece = "_"
        elif piece in ("(", "[", "{"):
            depth += 1
        elif piece in (")", "]", "}"):
            depth -= 1
        elif piece == "for":
            loops.append(depth)
        elif piece == "in" and loops and loops[-1] == depth:
            loops.pop()
            piece = "for_in"  # ``for name in ("attn", "mlp")`` iterates; it compares nothing
        if text and (text[-1].isalnum() or text[-1] == "_") and (piece[0].isalnum() or piece[0] == "_"):
            text += " "  # two names (``not in``) stay apart; other tokens join: ``HEAD.name``
        where.append((len(text), token.start[0]))
        text += piece
    return lines


def site_comparisons(source: str) -> list[tuple[int, str]]:
    """``(line number, matched text)`` of every site-name comparison in ``source``."""
    hits = []
    for text, where in _logical_lines(source):
        for match in SITE_COMPARISON.finditer(text):
            line = max(lineno for offset, lineno in where if offset <= match.start())
            hits.append((line, match.group().strip()))
    return hits


def _scanned() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(ROOT).as_posix() != "pipatch/_model/sites.py")


def _hits(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT).as_posix()}:{line}: {text}"
            for path in paths for line, text in site_comparisons(path.read_text(encoding="utf-8"))]


def test_no_module_but_sites_compares_site_names():
    hits = _hits(_scanned())
    assert not hits, ("site names compared outside pipatch/_model/sites.py; ask the Site instead "
                      "(pipatch._model.sites: site(name), axis_of(name), Site.per_head, .start_layer, ...):\n"
                      + "\n".join(hits))


# -- the grep itself ----------------------------------------------------------------------------

FOUND = [
    'return str(self.meta.get("col_axis") or ("head" if self.meta.get("site") == "head" else "token"))',
    'heads = meta.get("col_axis") == "head"',
    'if kind in ("patch", "attribution") and site not in SITES:',
    'if kind == "head":',
    'mlp = self.donor if (later == layer and kind == "mlp") else base',
    'meta.update({"site": view, "col_axis": "head" if view == HEAD.name else "component"})',
    'if sender is None or sender == "head":',
    'if isinstance(sender, (tuple, list)) and len(sender) == 3 and sender[0] == "head":',
    'if not (isinstance(receiver, (tuple, list)) and len(receiver) == 4 and receiver[0] == "head"\n'
    '        and receiver[3] in _QKV):',
    "if where.axis == 'head':",
    'return Cell(row, col, seed, start=row + 1 if self.site.where == "block" else row, ops=ops)',
    'inside = op.site.where != "block"  # a site the block computes: its rows only',
    'return module.input if site.where == "out_proj" else first(module.output)',
    'module, start = self.qkv[index], head if which == "q" else kv',
    'if value.lower() == "mlp":',
    'if "head" in kinds:',
    'if name in (\n    "resid",\n    "mlp",\n):',
    'match site:\n    case "resid":\n        pass',
    'if op.site.name == wanted:',
    'if target.name != name:',
]

NOT_FOUND = [
    'if direction == "mean":',
    'scorer = "prob" if metric == "prob" else metric',
    'return "logprob_diff" if self.name == "logit_diff" and not self.single else self.name',
    'return self.name in ("logit_diff", "logprob_diff")',
    'if kind in ("patch", "attribution"):',
    'what = {"head": "head", "token": "token"}.get(str(state.get("col_axis")), "column")',
    'meta = {"site": "resid", "col_axis": "token"}',
    'raise PipatchError("use site == \'head\' or kind in (\'resid\', \'mlp\')")',
    'x = 1  # if site == "head": a comment',
    'TEMPLATE = """\nwindow = [layer] if kind == "resid" else range(layer, layer + WINDOW)\n"""',
    'label = f"{site!r} == \'head\'"',
    'found = site_named(name)\nif found.per_head:\n    pass',
    'if sender_site is MLP:\n    pass',
    'if receiver[3] in QKV:\n    pass',
    'for what in ("embed", "blocks", "attn", "mlp", "out_proj", "unembed"):\n    pass',
    'names = [n for n in ("resid", "mlp") if n]',
    'if op.site.name not in values:\n    pass',
]


@pytest.mark.parametrize("source", FOUND)
def test_the_grep_finds_a_site_name_comparison(source):
    assert site_comparisons(source), source


@pytest.mark.parametrize("source", NOT_FOUND)
def test_the_grep_leaves_other_comparisons_alone(source):
    assert not site_comparisons(source), site_comparisons(source)


def test_the_grep_reports_the_line_of_the_comparison():
    source = 'x = (\n    a,\n    b == "head",\n)\n'
    assert [line for line, _ in site_comparisons(source)] == [3]


#: The commit before sites owned their semantics (#30), and the lines of the comparisons the
#: grep must find there (each one this change removed). The paths are the files' paths AT that
#: commit, before the layers (#56) moved them: they name history, not the tree.
BEFORE = "e3448c8"
BEFORE_HITS = {
    "pipatch/_code.py": [480, 482],
    "pipatch/_result.py": [207],
    "pipatch/_protocols/paths.py": [120, 126, 186, 221, 224, 226, 230, 244],
    "pipatch/_protocols/attribution.py": [93],
    "pipatch/_engine.py": [148, 157],
    "pipatch/_backends/transformers.py": [440],
    "pipatch/_backends/vllm.py": [266, 269],
    "pipatch/_models.py": [381],
    "pipatch/_registry.py": [110],
}


def _show(commit: str, path: str) -> str | None:
    try:
        done = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@pytest.mark.parametrize("path", sorted(BEFORE_HITS))
def test_the_grep_finds_the_comparisons_sites_replaced(path):
    """Run against the files as they were before #30: every known comparison is found."""
    source = _show(BEFORE, path)
    if source is None:
        pytest.skip(f"no git history with {BEFORE} here (an sdist, a shallow clone)")
    assert sorted({line for line, _ in site_comparisons(source)}) == BEFORE_HITS[path]
