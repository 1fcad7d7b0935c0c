"""Strings: made safe to send (the one JSON sanitiser) and made visible (the one escaper).

Two different jobs, kept apart:

* :func:`clean_text` / :func:`json_safe` change *data*: a lone surrogate cannot be encoded as
  UTF-8 (jupyter_client, nbformat and safetensors all fail on it), so it becomes U+FFFD, and
  NaN/±inf become ``null`` so every document is strict JSON. Everything pipatch sends or
  writes (widget traits, the MIME document, ``to_json``, ``Result.save``) goes through them;
  nothing else is changed (markup, NUL, bidi controls stay as written: escaping is the
  drawing's job, never the data's).
* :func:`escape_label` changes *what is drawn*: a character that would be invisible, reorder
  the text around it or break the line is drawn as ``⟨U+XXXX⟩``. The rule is the same in
  ``js/format.ts`` (``escapeLabel``) and is checked on every code point by
  ``js/__tests__/parity.test.ts``.

The escaping rule
-----------------
A code point is escaped when its General_Category is one of

* ``Cc`` control, ``Cf`` format (soft hyphen, zero-width space/joiners, bidi controls, BOM,
  interlinear annotation U+FFF9–FFFB, tags), ``Cs`` surrogate, ``Co`` private use,
  ``Zl`` line separator, ``Zp`` paragraph separator,
* ``Cn`` unassigned (noncharacters included),

or it is Default_Ignorable_Code_Point. In TypeScript that is one regular expression of
Unicode property escapes. Python's :mod:`unicodedata` has the categories but not
Default_Ignorable_Code_Point; by its definition (DerivedCoreProperties.txt: Cf +
Variation_Selector + Other_Default_Ignorable_Code_Point, less a few) the code points it adds
to the categories above are the variation selectors and six assigned Other_Default_Ignorable
characters (Hangul fillers, Khmer inherent vowels, the combining grapheme joiner), listed in
``_IGNORABLE_NOT_CF``; the rest of those two properties is unassigned, hence ``Cn``.

Unassigned code points are escaped on purpose: Python's Unicode database and the browser's
(V8's ICU) are often different Unicode versions, and a code point one side does not know yet
is then drawn as its number rather than as whatever glyph (or nothing) a font has for it.
Where the two versions agree on whether a code point is assigned, Python and TypeScript agree
on escaping it; where they do not, the side that does not know it escapes it (the parity test
checks both statements on all 1,114,112 code points).

A label made only of spaces is drawn as ``␣`` (at most eight): an empty-looking column
header would hide a real token.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

__all__ = ["ESCAPED_CATEGORIES", "clean_text", "escape_label", "is_escaped", "json_safe"]

_SURROGATE = re.compile("[\ud800-\udfff]")

#: General categories drawn as ``⟨U+XXXX⟩``.
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})

#: Default_Ignorable_Code_Point characters that are neither Cf nor Cn (see the module docstring).
_IGNORABLE_NOT_CF = (
    (0x034F, 0x034F),    # combining grapheme joiner (Other_Default_Ignorable)
    (0x115F, 0x1160),    # Hangul choseong / jungseong fillers (Other_Default_Ignorable)
    (0x17B4, 0x17B5),    # Khmer inherent vowels (Other_Default_Ignorable)
    (0x180B, 0x180D),    # Mongolian free variation selectors (Variation_Selector)
    (0x180F, 0x180F),    # Mongolian free variation selector four (Variation_Selector)
    (0x3164, 0x3164),    # Hangul filler (Other_Default_Ignorable)
    (0xFE00, 0xFE0F),    # variation selectors 1–16 (Variation_Selector)
    (0xFFA0, 0xFFA0),    # halfwidth Hangul filler (Other_Default_Ignorable)
    (0xE0100, 0xE01EF),  # variation selectors 17–256 (Variation_Selector)
)  # fmt: skip
_IGNORABLE_SET = frozenset(cp for lo, hi in _IGNORABLE_NOT_CF for cp in range(lo, hi + 1))


def clean_text(value: Any) -> str:
    """``str(value)`` safe for UTF-8: lone surrogates become U+FFFD.

    A lone surrogate (``"\\ud800"``, from a user string or a byte-level tokenizer) cannot be
    encoded as UTF-8: jupyter_client would fail to send the comm / display message, nbformat
    to save the notebook, safetensors to write the file. A valid pair written as two code
    points is joined.
    """
    s = str(value)
    if _SURROGATE.search(s) is None:
        return s
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def json_safe(value: Any) -> Any:
    """A JSON-like value made strict and UTF-8 safe: NaN/±inf → ``None``, every string (keys
    too) through :func:`clean_text`, tuples → lists. Other values are returned as they are
    (bytes of a binary array, say)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def is_escaped(cp: int) -> bool:
    """Whether code point ``cp`` is drawn as ``⟨U+XXXX⟩`` (the rule of the module docstring)."""
    return unicodedata.category(chr(cp)) in ESCAPED_CATEGORIES or cp in _IGNORABLE_SET


def escape_label(label: Any, max_chars: int | None = None) -> str:
    """``label`` as it is drawn: escaped characters as ``⟨U+XXXX⟩``, a label of spaces only as
    ``␣``, at most ``max_chars`` characters (the last one ``…``). Same as ``escapeLabel`` +
    ``truncateLabel`` in ``js/format.ts``."""
    s = str(label)
    if _SURROGATE.search(s) is not None:  # join pairs given as two code points, as JS sees them
        s = s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    s = "".join(f"⟨U+{ord(ch):04X}⟩" if is_escaped(ord(ch)) else ch for ch in s)
    if s and s.strip(" ") == "":
        s = "␣" * min(len(s), 8)
    if max_chars is not None and len(s) > max_chars:
        s = s[: max(1, max_chars - 1)] + "…"
    return s


def escaped_ranges() -> list[list[int]]:
    """Every escaped code point, as sorted ``[first, last]`` ranges (for the parity test)."""
    return _ranges(is_escaped)


def unassigned_ranges() -> list[list[int]]:
    """Every code point this Python's Unicode database does not assign (General_Category Cn)."""
    return _ranges(lambda cp: unicodedata.category(chr(cp)) == "Cn")


def _ranges(test) -> list[list[int]]:
    out: list[list[int]] = []
    for cp in range(0x110000):
        if test(cp):
            if out and out[-1][1] == cp - 1:
                out[-1][1] = cp
            else:
                out.append([cp, cp])
    return out
