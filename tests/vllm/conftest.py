"""The real-vLLM tier: fixtures that start real vLLM engines (CPU build, tiny
Qwen3 with random weights, scripts/install-vllm.sh) with kvroute's sidecars
and router in front. Run by scripts/test.sh with the vLLM venv's Python:

    target/vllm-venv/bin/python -m pytest tests/vllm

Nothing here skips: without vLLM or the kvroute binaries, the tests fail and
say what to install or build.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))

from harness import ALIAS, CHAT_DEFAULTS, MODEL, Engine, Router, Sidecar, binary, eventually, tiny_model  # noqa: E402


def pytest_sessionstart(session):
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"the real-vLLM tier needs vLLM ({e}): run scripts/install-vllm.sh and use target/vllm-venv/bin/python"
        )


class Cluster:
    """Two engines, a sidecar each, one router."""

    def __init__(self, num_blocks: int):
        tokenizer = tiny_model()
        binary("kvroute-router"), binary("kvroute-sidecar")
        flags = ["--served-model-name", MODEL, ALIAS, "--default-chat-template-kwargs", CHAT_DEFAULTS]
        self.engines = [Engine("w1", num_blocks, flags), Engine("w2", num_blocks, flags)]
        try:
            # Both engines load at once: start-up is mostly single-threaded.
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda e: e.wait_ready(), self.engines))
            self.router = Router(tokenizer, extra=["--default-chat-template-kwargs", CHAT_DEFAULTS])
            self.sidecars = [Sidecar(f"w{i + 1}", e, [self.router.url]) for i, e in enumerate(self.engines)]
            self.wait_registered()
        except BaseException:
            self.stop()
            raise

    def wait_registered(self):
        """Until the router has every worker, registered by its sidecar, healthy."""

        def probe():
            ws = self.router.workers()
            ok = all(ws.get(s.worker_id, {}).get("healthy") and ws[s.worker_id].get("sidecar") for s in self.sidecars)
            return True if ok else None

        eventually("the router to know every worker through its sidecar", 60, probe)

    def stop(self):
        for p in getattr(self, "sidecars", []):
            p.proc.stop()
        if hasattr(self, "router"):
            self.router.proc.stop()
        for e in self.engines:
            e.proc.stop()

    def logs(self) -> str:
        procs = [e.proc for e in self.engines] + [s.proc for s in getattr(self, "sidecars", [])]
        if hasattr(self, "router"):
            procs.append(self.router.proc)
        return "\n\n".join(f"--- {p.name} ({p.log_path})\n{p.log(30)}" for p in procs)


@pytest.fixture(scope="module")
def cluster():
    # 40 blocks of 32 tokens per engine: the tests' traffic needs several
    # times that, so engines evict.
    c = Cluster(num_blocks=40)
    yield c
    c.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    c = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if report.failed and c is not None:
        report.sections.append(("kvroute cluster logs", c.logs()))
