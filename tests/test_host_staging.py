"""engine/host_staging.py: which modules live in host memory, and pinned copies of results."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.offload.module import offload_module
from torch import nn

from llmcompressor_parallel.engine.host_staging import offloaded_to_host, staged_on_host


def test_offloaded_to_host_only_for_host_offloaded_modules(tmp_path):
    plain, offloaded, on_disk = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    offload_module(offloaded, onload_device="cpu", offload_device="cpu")
    offload_module(on_disk, onload_device="cpu", offload_device="disk", offload_dir=str(tmp_path))
    assert offloaded_to_host(offloaded)
    assert not offloaded_to_host(plain)
    assert not offloaded_to_host(on_disk)


def test_staging_leaves_host_tensors_and_other_values_alone():
    value = torch.randn(3, 5)
    tree = {"a": [value, 1.5], "b": None}
    staged = staged_on_host(tree)
    assert staged["a"][0] is value and staged["a"][1] == 1.5 and staged["b"] is None


@pytest.mark.gpu  # skipped by conftest.py without 2 GPUs
def test_staging_copies_cuda_tensors_into_pinned_host_memory():
    values = [torch.randn(64, 128, device=f"cuda:{i}").to(torch.bfloat16) for i in range(2)]
    staged = staged_on_host((values, [torch.arange(7, device="cuda:1")]))
    for original, copy in zip(values + [torch.arange(7)], staged[0] + staged[1]):
        assert copy.device.type == "cpu" and copy.is_pinned()
        assert copy.dtype == original.dtype and torch.equal(copy, original.cpu())
