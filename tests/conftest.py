import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs at least 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """CPU "devices" are worker threads: with several OpenMP threads each on a 2-core
    machine, spin-waiting thread teams oversubscribe it and a tiny run takes a minute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny dense and MoE models of tiny_models.py, saved once per test module."""
    from tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {kind: save_tiny_model(kind, root / kind) for kind in ("dense", "moe")}


@pytest.fixture
def linear_fails_on_worker_1(monkeypatch):
    """Every nn.Linear raises in the thread of pool worker 1, and only there."""
    import threading

    original = torch.nn.Linear.forward

    def failing(self, x):
        if threading.current_thread().name.startswith("llmc-parallel-1"):
            raise RuntimeError("injected replica failure")
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", failing)
