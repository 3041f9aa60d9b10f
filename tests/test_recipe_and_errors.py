"""Recipe YAML support, construction-time validation and refusals."""

import datetime

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

import llmcompressor_parallel  # noqa: F401  (registers the modifiers)
from llmcompressor.recipe import Recipe
from llmcompressor_parallel import DataParallelAutoRoundModifier
from llmcompressor_parallel.recipes import recipe_path

YAML = """
quant_stage:
  quant_modifiers:
    DataParallelAutoRoundModifier:
      targets: ["Linear"]
      scheme: W4A16
      ignore: ["lm_head"]
      iters: 3
      data_parallel: ["cpu", "cpu"]
      parallel_batch: per_replica
"""


def test_yaml_recipe_names_the_modifier():
    recipe = Recipe.create_instance(YAML)
    (modifier,) = recipe.modifiers
    assert isinstance(modifier, DataParallelAutoRoundModifier)
    assert modifier.data_parallel == ["cpu", "cpu"]
    assert modifier.parallel_batch == "per_replica"
    assert modifier.iters == 3


def test_shipped_recipe_parses():
    recipe = Recipe.create_instance(str(recipe_path("demo_autoround_w4a16")))
    assert type(recipe.modifiers[0]).__name__ == "DataParallelAutoRoundModifier"


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("data_parallel", "fast", "allowed values"),
        ("data_parallel", 1, "one replica is the stock modifier"),
        ("data_parallel", ["cuda:0"], "fewer than two devices"),
        ("parallel_batch", "each", "allowed values: 'split', 'per_replica'"),
        ("grouped_experts", "yes", "allowed values: True, False"),
        ("keep_cache_on_gpu", "gpu", "allowed values: None, True, False"),
        ("nan_fill_new_tensors", "no", "allowed values: True, False"),
    ],
)
def test_bad_knobs_fail_at_construction(field, value, fragment):
    with pytest.raises(ValidationError, match=fragment):
        DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear", **{field: value})


def test_active_process_group_is_refused_with_a_reason(tmp_path):
    """AutoRound refuses torchrun (auto-round's own DDP); GPTQ resolves the rank's devices."""
    from llmcompressor_parallel import ParallelGPTQExpertModifier
    from llmcompressor_parallel.modifiers.data_parallel_options import refuse_active_process_group

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        with pytest.raises(RuntimeError, match="torchrun"):
            refuse_active_process_group()
        modifier = DataParallelAutoRoundModifier(
            scheme="W4A16", targets="Linear", data_parallel=["cpu", "cpu"]
        )
        with pytest.raises(RuntimeError, match="active torch.distributed"):
            modifier.resolve_parallel_devices()
        off = DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear")
        assert off.resolve_parallel_devices() is None  # "off" composes with DDP as stock does

        def gptq(data_parallel):
            return ParallelGPTQExpertModifier(
                scheme="W4A16", targets="Linear", data_parallel=data_parallel
            )

        assert gptq(["cpu", "cpu"]).resolve_parallel_devices() == [torch.device("cpu")] * 2
        assert gptq("off").resolve_parallel_devices() is None
        if not torch.cuda.is_available():
            assert gptq("auto").resolve_parallel_devices() is None  # no GPU: serial
            with pytest.raises(ValueError, match="local rank 0 of 1 is dealt 0"):
                gptq(2).resolve_parallel_devices()
    finally:
        dist.destroy_process_group()


def test_ranks_are_dealt_disjoint_gpus_including_their_own():
    from llmcompressor_parallel.engine.rank_devices import dealt_gpus

    assert dealt_gpus(8, 0, 1) == list(range(8))  # one rank per node: every GPU
    assert [dealt_gpus(8, rank, 2) for rank in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dealt_gpus(8, 3, 8) == [3]
    with pytest.raises(ValueError, match="outside LOCAL_WORLD_SIZE"):
        dealt_gpus(8, 2, 2)


def test_ranks_sharing_a_gpu_are_named():
    from llmcompressor_parallel.engine.rank_devices import RankGPUs, shared_gpus

    ranks = [
        RankGPUs("node-a", ["GPU-0", "GPU-1"], ["cuda:0", "cuda:1"]),
        RankGPUs("node-a", ["GPU-1", "GPU-2"], ["cuda:1", "cuda:2"]),
        RankGPUs("node-b", ["GPU-0", "GPU-1"], ["cuda:0", "cuda:1"]),  # another host
    ]
    assert shared_gpus(ranks) == [
        "ranks 0 (['cuda:0', 'cuda:1']) and 1 (['cuda:1', 'cuda:2']) on host node-a share GPU GPU-1"
    ]
    assert shared_gpus(ranks[:1] + ranks[2:]) == []
