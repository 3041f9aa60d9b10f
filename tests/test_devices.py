import pytest
import torch

from llmcompressor_parallel.engine.devices import resolve_devices, validate_data_parallel


@pytest.mark.parametrize("value", ["off", "auto", 2, 8, ["cpu", "cpu"], ["cuda:0", "cuda:2"]])
def test_valid_values_pass(value):
    assert validate_data_parallel(value) == value


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("on", "'on' is not valid"),
        (1, "one replica is the stock modifier"),
        (0, "not valid"),
        (-3, "not valid"),
        (True, "not valid"),
        (["cpu"], "fewer than two devices"),
        ([], "fewer than two devices"),
        (["cpu", "gpu7"], "is not a device"),
        (["cpu", "mps"], "only \"cpu\" and \"cuda\""),
        (["cpu", 3], "is not a string"),
        (2.5, "not valid"),
    ],
)
def test_invalid_values_name_the_allowed_ones(value, fragment):
    with pytest.raises(ValueError) as error:
        validate_data_parallel(value)
    assert fragment in str(error.value)
    assert "allowed values" in str(error.value) or "supported" in str(error.value)


def test_yaml_off_which_yaml_reads_as_false_means_off():
    import yaml

    assert validate_data_parallel(yaml.safe_load("data_parallel: off")["data_parallel"]) == "off"


def test_off_resolves_to_serial():
    assert resolve_devices("off") is None


def test_cpu_lists_resolve_to_cpu_devices():
    assert resolve_devices(["cpu", "cpu", "cpu"]) == [torch.device("cpu")] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_auto_without_gpus_is_serial():
    assert resolve_devices("auto") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_more_gpus_than_visible_fails_naming_the_count():
    with pytest.raises(ValueError, match="asks for 2 GPUs but 0 are visible"):
        resolve_devices(2)
    with pytest.raises(ValueError, match="does not exist: 0 GPU"):
        resolve_devices(["cpu", "cuda:1"])
