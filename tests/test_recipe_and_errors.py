"""Recipe YAML support, construction-time validation and refusals."""

import datetime

import pytest
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
    ],
)
def test_bad_knobs_fail_at_construction(field, value, fragment):
    with pytest.raises(ValidationError, match=fragment):
        DataParallelAutoRoundModifier(scheme="W4A16", targets="Linear", **{field: value})


def test_active_process_group_is_refused_with_a_reason(tmp_path):
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
    finally:
        dist.destroy_process_group()
