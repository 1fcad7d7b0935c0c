"""Third-party internals in one place per library, the version check, and no state on the
user's objects (pipatch._compat, pipatch._base.known).

No model is loaded but tiny random ones (tests/_tiny.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

import pipatch
import pipatch._compat as compat
from pipatch._backends import backend_for
from pipatch._base.errors import PipatchError, PipatchWarning
from pipatch._compat import nnsight as nnsight_compat
from tests._tiny import tiny_model

TINY_CLEAN, TINY_CORRUPT = "The Colosseum is in the city of", "The Kremlin is in the city of"


def test_an_untested_version_warns_once_when_a_backend_is_made(monkeypatch):
    monkeypatch.setitem(compat.TESTED, "nnsight", ("0.7.0", "0.7.0"))  # the installed 0.8.1 is then untested
    compat.warn_untested.cache_clear()
    try:
        with pytest.warns(PipatchWarning) as caught:
            backend_for(tiny_model("llama"))
            backend_for(tiny_model("llama"))
        lines = [str(w.message) for w in caught if issubclass(w.category, PipatchWarning)]
        assert lines == ["pipatch was tested with nnsight 0.7.0; this is nnsight 0.8.1: pip install "
                         "'nnsight==0.7.0', or expect failures"]
    finally:
        compat.warn_untested.cache_clear()


def test_a_missing_private_name_is_one_line_naming_the_versions():
    """A real envoy without ``_module`` (as an nnsight that renamed it would build): the
    first use is one line naming the name, the installed version and the tested one."""
    model = tiny_model("llama")
    block = model.model.layers[0]
    del vars(block)["_module"]
    with pytest.raises(PipatchError) as caught:
        nnsight_compat.torch_module(block)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("pipatch needs nnsight's Envoy._module, which nnsight 0.8.1 does not have")
    assert "tested with nnsight 0.8.1" in message and "pip install 'nnsight==0.8.1'" in message


def test_a_persistent_id_is_put_back_as_it_was():
    model = tiny_model("llama")
    with nnsight_compat.persistent_id(model, "pipatch:model"):
        assert vars(model)["_persistent_id"] == "pipatch:model"
    assert "_persistent_id" not in vars(model)
    module = nnsight_compat.torch_module(model)
    before = vars(module).get("_persistent_id")  # nnsight tags modules itself when it pickles an envoy
    with nnsight_compat.persistent_id(module, "x"):
        pass
    assert vars(module).get("_persistent_id") == before


# --------------------------------------------------------------------------------------------
# No state on the user's objects
# --------------------------------------------------------------------------------------------


def _pipatch_attributes(model) -> list[str]:
    """Every ``_pipatch*`` attribute on ``model``, its envoys and its torch modules."""
    module = nnsight_compat.torch_module(model)
    found = [f"model.{key}" for key in vars(model) if key.startswith("_pipatch")]
    found += [f"{name or 'module'}.{key}" for name, sub in module.named_modules() for key in vars(sub)
              if key.startswith("_pipatch")]
    envoys = [value for value in vars(model).values() if type(value).__name__ == "Envoy"]
    while envoys:
        envoy = envoys.pop()
        found += [f"envoy.{key}" for key in vars(envoy) if key.startswith("_pipatch")]
        envoys += [value for value in vars(envoy).values() if type(value).__name__ == "Envoy"]
    return found


def test_a_patch_sets_nothing_on_the_model_and_lets_it_go():
    model = tiny_model("llama")
    result = pipatch.patch(model, clean=TINY_CLEAN, corrupt=TINY_CORRUPT, answer=" Rome", foil=" Moscow",
                           site="resid", positions=[-1])
    assert result.status == "done" and result.meta["model"] == "tiny-llama"  # the name, kept beside the model
    assert _pipatch_attributes(model) == []
    assert "_persistent_id" not in vars(model)
    gone = weakref.ref(model)
    del model, result
    gc.collect()
    assert gone() is None, "something pipatch keeps holds the model"


def test_the_backend_is_shared_while_held_and_dispatch_reads_no_attribute():
    from pipatch._base.known import known, remember

    model = tiny_model("llama")
    backend = backend_for(model)
    assert backend_for(model) is backend and backend.backend_name == "transformers"
    del backend
    gc.collect()
    assert known(model).backend() is None  # held weakly: a backend holds its model
    remember(model, remote="local")  # what load_model(..., remote="local") records
    assert backend_for(model).backend_name == "ndif"
    assert _pipatch_attributes(model) == []

