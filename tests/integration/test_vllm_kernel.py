"""The vLLM backend in a real Jupyter kernel: ``%%patch --backend vllm``, Kernel ▸ Interrupt.

A kernel of this Python is started with jupyter_client (as JupyterLab starts one); the test
sends cells and reads the kernel's messages. The second sweep is interrupted the way Kernel ▸
Interrupt does it (``KernelManager.interrupt_kernel``: SIGINT to the kernel process) once the
live grid has drawn two rows. Then: the partial result is bound, the engine (in the kernel's
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) holds no request, and a third sweep in the same
kernel finishes with the numbers of the first, on the same engine.

Then the same with a TP=2 engine in a fresh kernel: the interrupt keeps both rank processes
(Jupyter signals the kernel's whole process group, and vLLM's workers exit on SIGINT: before
pipatch's CPU worker ignored it in rank processes, the next sweep failed with "RuntimeError:
cancelled"), and Kernel ▸ Restart leaves no rank process behind.

Each kernel starts its own vLLM engine (about 5 GB; 8 GB split): run this module in a pytest
process of its own, not after ``test_vllm.py`` (``make test-vllm`` does).
"""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs pip install 'pipatch[vllm]' (make install-vllm)")
jupyter_client = pytest.importorskip("jupyter_client")

from tests.conftest import COLOSSEUM, EIFFEL  # noqa: E402

pytestmark = pytest.mark.vllm

PAIR_BODY = f"clean: {EIFFEL}\ncorrupt: {COLOSSEUM}"
FLAGS = '--backend vllm --answer " Paris" --foil " Rome"'


class Kernel:
    """One kernel of this interpreter and a client; ``run`` executes a cell and collects its output."""

    def __init__(self, cwd: str):
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # pipatch must choose in-process itself
        self.manager.start_kernel(cwd=cwd, env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def send(self, code: str) -> str:
        return self.client.execute(code, store_history=True)

    def collect(self, msg_id: str, timeout: float, on_message=None) -> dict:
        """Read iopub until the cell is idle; returns its stdout, stderr, error and message types."""
        out = {"stdout": "", "stderr": "", "error": None, "types": []}
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell still running after {timeout:.0f} s; got {out}")
            msg = self.client.get_iopub_msg(timeout=left)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            out["types"].append(kind)
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                out["error"] = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                return out
            if on_message is not None:
                on_message(msg)

    def run(self, code: str, timeout: float = 600) -> dict:
        return self.collect(self.send(code), timeout)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def _interrupter(kernel: Kernel):
    """What Kernel ▸ Interrupt does once the live grid has drawn two rows: ``(seen, on_message)``
    for :meth:`Kernel.collect`; ``seen["interrupted"]`` says whether it fired."""
    seen = {"rows": 0, "interrupted": False}

    def interrupt_after_two_rows(msg):
        if msg["msg_type"] != "comm_msg":
            return
        state = (msg["content"].get("data") or {}).get("state") or {}
        seen["rows"] = max(seen["rows"], int((state.get("rows_done") or {}).get("resid", 0)))
        if seen["rows"] >= 2 and not seen["interrupted"]:
            seen["interrupted"] = True
            kernel.manager.interrupt_kernel()

    return seen, interrupt_after_two_rows


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(str(tmp_path))  # closed after its test: the next test's kernel starts an engine of its own
    yield k
    k.close()


def test_interrupting_a_vllm_sweep_in_a_kernel(kernel):
    setup = kernel.run(f"import sys; assert sys.prefix == {sys.prefix!r}\n%load_ext pipatch")
    assert setup["error"] is None, setup

    # 1. The engine starts on the first cell and runs a small sweep.
    first = kernel.run(f"%%patch {FLAGS} --positions -1 -o small\n{PAIR_BODY}", timeout=900)
    assert first["error"] is None, first
    check = kernel.run("import pipatch._backends._load as m\n"
                       "engine = [v for k, v in m._SHARED.items() if k[-1] == 'vllm']\n"
                       "print(small.status, small.meta['backend'], len(engine))")
    assert check["stdout"].split() == ["done", "vllm", "1"], check

    # 2. A full grid, interrupted once the live grid has drawn two rows.
    seen, interrupt_after_two_rows = _interrupter(kernel)

    started = time.monotonic()
    swept = kernel.collect(kernel.send(f"%%patch {FLAGS} --site resid --batch-size 1 -o big\n{PAIR_BODY}"), 600,
                           interrupt_after_two_rows)
    assert seen["interrupted"], f"the sweep ended before it could be interrupted: {swept}"
    assert swept["error"] is None, swept  # the magic ends the cell normally, with the partial grid
    assert "interrupted" in swept["stderr"] and "bound to big" in swept["stderr"], swept
    print(f"interrupted after {time.monotonic() - started:.1f} s")
    # Rows run from the last layer down: the finished ones are the top rows.
    partial = kernel.run("import torch\n"
                         "done = list(big.finished_rows('resid'))\n"
                         "engine = m._SHARED[[k for k in m._SHARED if k[-1] == 'vllm'][0]]\n"
                         "print(big.status, len(done), int(torch.isfinite(big.raw['resid'][0, done]).all()),\n"
                         "      int(engine.vllm_entrypoint.llm_engine.has_unfinished_requests()))")
    status, done, finite, busy = partial["stdout"].split()
    assert status == "interrupted" and 0 < int(done) < 18 and finite == "1" and busy == "0", partial

    # 3. The same kernel, the same engine: the next sweep finishes, with the first sweep's numbers.
    again = kernel.run(f"%%patch {FLAGS} --positions -1 -o again\n{PAIR_BODY}", timeout=600)
    assert again["error"] is None, again
    same = kernel.run("print(again.status, len([k for k in m._SHARED if k[-1] == 'vllm']),\n"
                      "      m._SHARED[[k for k in m._SHARED if k[-1] == 'vllm'][0]] is engine,\n"
                      "      bool(torch.equal(again.raw['resid'], small.raw['resid'])),\n"
                      "      bool(torch.allclose(big.raw['resid'][0, done, -1], small.raw['resid'][0, done, 0],"
                      " atol=1e-4)))")
    assert same["stdout"].split() == ["done", "1", "True", "True", "True"], same


def _alive_after(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` still alive once all have ended or ``timeout`` s have passed
    (zombies count as ended)."""
    psutil = pytest.importorskip("psutil")
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def test_a_split_engine_in_a_kernel_survives_an_interrupt_and_a_restart_leaves_no_worker(tmp_path):
    """TP=2 in a kernel: Kernel ▸ Interrupt mid-sweep keeps the rows and both ranks (the next
    sweep runs on them); Kernel ▸ Restart then leaves no worker process behind."""
    kernel = Kernel(str(tmp_path))
    try:
        flags = f"{FLAGS} --tensor-parallel-size 2"
        assert kernel.run("%load_ext pipatch")["error"] is None
        first = kernel.run(f"%%patch {flags} --positions -1 -o small\n{PAIR_BODY}", timeout=900)
        assert first["error"] is None, first
        ranks = kernel.run("from pipatch._backends import backend_for\n"
                           "import pipatch._backends._load as m\n"
                           "engine = [v for k, v in m._SHARED.items() if k[-1] == 'vllm'][0]\n"
                           "print(*[r['pid'] for r in backend_for(engine).rank_memory()])")
        workers = [int(pid) for pid in ranks["stdout"].split()]
        assert len(workers) == 2 and _alive_after(workers, 0) == workers, ranks

        seen, interrupt_after_two_rows = _interrupter(kernel)

        swept = kernel.collect(kernel.send(f"%%patch {flags} --site resid --batch-size 1 -o big\n{PAIR_BODY}"), 600,
                               interrupt_after_two_rows)
        assert seen["interrupted"] and swept["error"] is None and "interrupted" in swept["stderr"], swept
        assert _alive_after(workers, 0) == workers, "an interrupt took a rank down"
        again = kernel.run(f"%%patch {flags} --positions -1 -o again\n{PAIR_BODY}", timeout=600)
        assert again["error"] is None, again
        same = kernel.run("import torch; print(again.status, bool(torch.equal(again.raw['resid'], small.raw['resid'])))")
        assert same["stdout"].split() == ["done", "True"], same

        kernel.manager.restart_kernel(now=True)
        kernel.client.wait_for_ready(timeout=120)
        left = _alive_after(workers, 60)
        assert not left, f"rank processes {left} outlived the kernel restart"
    finally:
        kernel.close()
