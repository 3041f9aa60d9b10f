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
