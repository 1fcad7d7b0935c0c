"""What a newcomer reads first: the README (short, its links alive), the API reference (every
public name), the docstrings (Python's spelling, not the CLI's) and ``pipatch --help`` (every
command). The site itself is built by ``make docs`` (``mkdocs build --strict``: a broken link
between its pages, a missing heading or an unknown name fails it), which ``make test`` runs."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pipatch
from pipatch import cli
from pipatch._experiments._registry import EXPERIMENTS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

#: A Markdown link's or an HTML image's target: ``[text](target)``, ``src="target"``.
LINK = re.compile(r"\]\(([^)\s]+)\)|\bsrc=\"([^\"]+)\"")
#: A command-line flag in running text: ``--subject``, not ``a -- b`` nor ``x--y``.
FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` (mkdocs, and GitHub alike for plain headings) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, outside its code blocks."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#").strip()))
    return anchors


def test_the_readme_is_at_most_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into a page of docs/"


def test_the_readmes_relative_links_resolve():
    """Every relative link of the README names a file of the repository, and a heading of it
    where it names one; links to the web are not fetched."""
    targets = [a or b for a, b in LINK.findall(README.read_text(encoding="utf-8"))]
    relative = [t for t in targets if not re.match(r"[a-z][a-z+.-]*:", t)]
    assert len(relative) >= 10, "the README links into docs/: its links were not found"
    broken = []
    for target in relative:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        if not file.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: {path or 'README.md'} has no heading #{anchor}")
    assert not broken, "README.md: " + "; ".join(broken)


def test_the_api_reference_lists_every_public_name():
    """``::: pipatch.NAME`` (mkdocstrings) for every name of ``pipatch.__all__``, and none that
    is not one (a name removed from the package must leave the reference too)."""
    pages = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    referenced = set(re.findall(r"^::: pipatch\.([\w.]+)\s*$", pages, flags=re.MULTILINE))
    missing = set(pipatch.__all__) - referenced
    assert not missing, f"the API reference (docs/reference.md) lacks {sorted(missing)}"
    unknown = {name for name in referenced if name.split(".")[0] not in pipatch.__all__}
    assert not unknown, f"the API reference documents {sorted(unknown)}, which pipatch does not export"


def test_the_pages_name_only_what_pipatch_has():
    """Every ``pipatch.NAME`` (and ``pipatch.tasks.NAME``) the README and the pages mention exists:
    a renamed function leaves no stale example behind. ``"pipatch.experiments"`` and
    ``"pipatch.programs"`` are entry-point groups' names."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [README, *DOCS.rglob("*.md")])
    names = set(re.findall(r"\bpipatch\.([a-zA-Z]\w*(?:\.[a-zA-Z]\w*)?)", text))
    assert {"trace", "tasks.ioi", "load_model"} <= names
    unknown = set()
    for dotted in names - {"experiments", "programs"}:
        obj = pipatch
        for part in dotted.split("."):
            if not hasattr(obj, part):
                unknown.add(dotted)
                break
            obj = getattr(obj, part)
    assert not unknown, f"the docs name what pipatch lacks: {sorted(unknown)}"


def _public_docstrings() -> dict[str, str]:
    """Every public name's docstring, with those of a class's public members and a module's."""
    docs: dict[str, str] = {}
    for name in pipatch.__all__:
        obj = getattr(pipatch, name)
        if isinstance(obj, str):  # __version__
            continue
        docs[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            members = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        elif inspect.ismodule(obj):
            members = {k: getattr(obj, k) for k in getattr(obj, "__all__", ())}
        else:
            members = {}
        for key, member in members.items():
            docs[f"{name}.{key}"] = inspect.getdoc(member) or ""
    return docs


def test_public_docstrings_read_as_python():
    """No ``--flag`` (a keyword is ``subject=``, a value ``("head", 12, 2)``) and no "The the"
    (the prompt's text was once the magic's cell-body help, rewritten)."""
    docs = _public_docstrings()
    assert {"trace", "patch", "path_patch", "load_model", "Result.save"} <= set(docs)
    bad = {name: [line.strip() for line in doc.splitlines() if FLAG.search(line) or "The the" in line]
           for name, doc in docs.items()}
    bad = {name: lines for name, lines in bad.items() if lines}
    assert not bad, f"CLI wording in Python docstrings: {bad}"


def test_a_flags_spelling_is_in_the_commands_help_not_the_docstring():
    """A parameter's text is written once; the flag's own spelling of a value (``12.2`` for
    ``("head", 12, 2)``) is added to the command's help alone."""
    command = cli.build_parser().commands["path-patch"].format_help()
    doc = pipatch.path_patch.__doc__
    for text in ("('head', layer, h)", "senders sit below the first receiver"):
        assert text in doc and text in " ".join(command.split())
    assert "LAYER.HEAD" in command and "LAYER.HEAD" not in doc
    assert "The prompt." in pipatch.trace.__doc__ and "cell body" not in pipatch.trace.__doc__


def test_pipatch_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "pipatch.cli", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^ {4}(\S+)", out.stdout, flags=re.MULTILINE))
    expected = {entry.command for entry in EXPERIMENTS.values()} | {"compare", "study", "serve"}
    assert listed == expected, out.stdout
