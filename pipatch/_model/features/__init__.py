"""Features: SAE and transcoder latents as sites (issue #46).

:func:`load_sae` reads an SAE (an SAELens ``SAE`` object, a folder in SAELens's or Gemma Scope
2's format, or an SAELens release and id) and, given a model, maps where it reads through the
model's adapter (:mod:`.hooks`) into a :class:`~.site.LatentSite`: a site like any other,
whose value is the SAE's latents and whose writes keep the SAE's error in the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._base.errors import PipatchError
from ..._base.known import known
from ..._compat.nnsight import torch_module
from ..models import adapter_for
from .hooks import Hook, locate
from .sae import SAE, from_release, from_saelens, read_folder
from .site import InOut, LatentSite, latent_site

__all__ = ["load_sae", "load_saes", "embedded_sae", "EMBEDDED_SAE", "SAE", "LatentSite", "InOut", "Hook"]


def _read(source: Any, sae_id: str | None, name: str | None) -> SAE:
    """The :class:`SAE` ``source`` names (see :func:`load_sae`)."""
    if isinstance(source, SAE):
        return source
    if isinstance(source, tuple) and len(source) == 2 and all(isinstance(s, str) for s in source):
        return from_release(*source)
    if hasattr(source, "cfg") and hasattr(source, "W_enc"):
        return from_saelens(source, name)
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.is_dir():
            return read_folder(path, name)
        if sae_id is not None:
            return from_release(str(source), sae_id)
        raise PipatchError(f"SAE source {str(source)!r} is not a folder: pass an SAE folder, an SAELens SAE, "
                           "or a release with its id (load_sae(release, model, sae_id=...))")
    raise PipatchError(f"cannot load an SAE from {type(source).__name__}: pass an SAELens SAE, an SAE folder, "
                       "or an SAELens release and id")


def _model_label(model: Any) -> str | None:
    """The name the model was loaded by (``None`` for a local folder: it says nothing)."""

    label = known(model).name or getattr(torch_module(model), "name_or_path", None)
    if not label or Path(str(label)).expanduser().exists():
        return None
    return str(label)


def _same_model(a: str, b: str) -> bool:
    def norm(text: str) -> str:
        return text.lower().replace(" (embedded)", "").rsplit("/", 1)[-1].removesuffix("-pt")
    return norm(a) == norm(b)


def bind(sae: SAE, model: Any, name: str | None = None, check_model: bool = True) -> LatentSite:
    """The :class:`LatentSite` of ``sae`` in ``model``: where it reads (and writes) mapped
    through the model's adapter, its widths and model checked (one line each)."""
    adapter = adapter_for(model)
    what = f"SAE {sae.name!r}"
    label = _model_label(model)
    if check_model and sae.model_name and label and not _same_model(sae.model_name, label):
        raise PipatchError(f"{what} was trained on {sae.model_name!r}, not on this model ({label!r}): load an SAE "
                           "of this model, or pass check_model=False if it is the same model under another name")
    reads = locate(sae.hook, adapter, what)
    writes = reads
    if sae.transcoder:
        writes = locate(str(sae.hook_out), adapter, what)
        if (reads.kind, writes.kind) != ("mlp_input", "mlp_output") or reads.layer != writes.layer:
            raise PipatchError(f"transcoder {sae.name!r} reads {sae.hook!r} and writes {sae.hook_out!r}: pipatch "
                               "patches transcoders that read a layer's MLP input and write that layer's MLP output")
    for hook, size, side in ((reads, sae.d_in, "reads"), (writes, sae.d_out, "writes")):
        if size != hook.width(adapter):
            raise PipatchError(f"{what} {side} {size}-wide values, but this {adapter.family} model's {hook.kind} at layer "
                               f"{hook.layer} is {hook.width(adapter)} wide: load an SAE trained on this model")
    weights = next(iter(torch_module(model).parameters()), None)
    if weights is not None and weights.device.type != "meta":  # a served model's tree holds no weights
        sae.to(device=weights.device)  # the SAE's math stays in its own dtype; writes are cast to the model's
    site = latent_site(sae, reads, writes, name or f"L{reads.layer} {'transcoder' if sae.transcoder else reads.kind}")
    site.check(adapter)
    return site


def load_sae(source: Any, model: Any = None, *, sae_id: str | None = None, name: str | None = None,
             check_model: bool = True) -> Any:
    """Load a sparse autoencoder or transcoder, as a latent site of ``model``.

    Parameters
    ----------
    source
        An SAELens ``SAE`` object (read as it is; SAELens is not imported otherwise); a folder
        in SAELens's disk format (``cfg.json`` + ``sae_weights.safetensors``) or Gemma Scope 2's
        (``config.json`` naming ``hf_hook_point_in`` + ``params.safetensors``); or an SAELens
        release and id, as a tuple ``("gemma-scope-2-270m-pt-res", "layer_12_width_16k_l0_small")``
        or as ``source`` with ``sae_id=`` (downloaded by SAELens: needs ``pipatch[sae]`` and the
        hub). Architectures: ReLU, JumpReLU, TopK, and transcoders (with or without an affine
        skip).
    model
        The model the SAE reads: its config's hook name (``blocks.12.hook_resid_post``,
        ``model.layers.12.output``, ...) is mapped through the model's adapter. ``None``: the
        SAE's weights alone (a :class:`SAE`), unplaced.
    sae_id
        The SAE's id within the release ``source`` names.
    name
        The site's name (results key values by it); default ``"L<layer> <kind>"`` (``"L3 resid_post"``,
        ``"L1 transcoder"``).
    check_model
        Refuse an SAE whose config names another model than ``model``'s name (default). Pass
        ``False`` for the same model under another name.

    Returns
    -------
    LatentSite or SAE
        With ``model``: the latent site (``site.sae`` its weights, ``site.layer`` its layer),
        which patch programs take like any site. Without: the :class:`SAE`.

    Raises
    ------
    PipatchError
        One line naming the problem and the fix: a source in no supported format, an
        unsupported architecture or normalization, a hook pipatch does not read, a layer the
        model lacks, a width other than the model's, another model, SAELens missing or the hub
        unreachable for a release.
    """
    sae = _read(source, sae_id, name)
    return sae if model is None else bind(sae, model, name, check_model)


#: The SAE pipatch ships for the embedded Gemma 3 270M: 2,048 TopK latents (k = 32) of block
#: 6's output, trained with SAELens's trainer by ``scripts/train_sae.py`` (its corpus, settings
#: and held-out L0, explained variance and dead share: ``metrics.json`` beside the weights).
EMBEDDED_SAE = Path(__file__).resolve().parents[2] / "data" / "sae" / "gemma-3-270m-res-l6-topk-2k"


def embedded_sae(model: Any = None) -> Any:
    """The SAE shipped for the embedded model (:data:`EMBEDDED_SAE`), as :func:`load_sae`
    reads it: the latent site of ``model`` at layer 6, or its :class:`SAE` without one.
    Its folder is ``pipatch.embedded_sae().folder``."""
    return load_sae(EMBEDDED_SAE, model)


def load_saes(sources: Sequence[Any], model: Any, *, check_model: bool = True) -> list[LatentSite]:
    """:func:`load_sae` for several SAEs (one per layer, say) of one model: their latent sites,
    in the order given. Two that would share a name are refused (pass each one's ``name`` via
    :func:`load_sae`)."""
    return distinct([load_sae(source, model, check_model=check_model) for source in sources])


def distinct(sites: list[LatentSite]) -> list[LatentSite]:
    """``sites``, refused in one line where two share a name (results key values by it)."""
    names = [site.name for site in sites]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PipatchError(f"several SAEs are called {', '.join(map(repr, twice))} (one place, one name): load them "
                           "one by one with load_sae(..., name=...) to tell them apart")
    return sites
