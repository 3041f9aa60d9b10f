"""The `llmc-parallel oneshot` command on a local model folder, no Python from the user."""

import json

import pytest
import torch

from llmcompressor_parallel.cli import _parse_data_parallel, main
from tiny_models import load_saved_tensors

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

RECIPE = """
quant_stage:
  quant_modifiers:
    ParallelGPTQExpertModifier:
      targets: ["Linear"]
      scheme: W4A16
      ignore: ["lm_head"]
      data_parallel: off
"""


@pytest.mark.parametrize(
    "text, value",
    [("off", "off"), ("auto", "auto"), ("4", 4), ("cpu,cpu", ["cpu", "cpu"]),
     ("cuda:0, cuda:2", ["cuda:0", "cuda:2"])],
)
def test_data_parallel_option_parses(text, value):
    assert _parse_data_parallel(text) == value


def test_oneshot_command_runs_a_recipe_on_a_local_model(model_dirs, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    texts = tmp_path / "calibration.jsonl"
    texts.write_text("\n".join(json.dumps({"text": " ".join(f"t{i % 500}" for i in range(j, j + 64))})
                               for j in range(8)))
    output = tmp_path / "out"
    code = main(["oneshot", "--model", str(model_dirs["dense"]), "--recipe", str(recipe),
                 "--output-dir", str(output), "--dataset", str(texts), "--samples", "8",
                 "--seq-len", "32", "--data-parallel", "cpu,cpu", "--pipeline", "parallel_sequential"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["output_dir"] == str(output.resolve())
    tensors = load_saved_tensors(output)
    assert any(name.endswith("weight_packed") for name in tensors)




@pytest.mark.parametrize("command", ["demo", "oneshot"])
def test_commands_seed_the_shuffle_oneshot_makes(command, model_dirs, tmp_path, monkeypatch, capsys):
    """oneshot draws its calibration shuffle from torch's global generator (seeded from
    entropy at start-up): both commands seed it right before oneshot, so whatever state
    the process is in, oneshot sees the generator of `--seed`."""
    import llmcompressor

    draws = []

    def recording_oneshot(model, output_dir, **_kwargs):
        draws.append(torch.randint(0, 2**31, (4,)).tolist())
        if command == "demo":  # the demo reloads what oneshot saved
            model.save_pretrained(output_dir)

    monkeypatch.setattr(llmcompressor, "oneshot", recording_oneshot)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    for run in range(2):
        torch.manual_seed(1000 + run)  # whatever state the process is in
        if command == "demo":
            args = ["demo", "--output-dir", str(tmp_path / f"out{run}"), "--data-parallel", "off",
                    "--samples", "2", "--seq-len", "16", "--kl-chunks", "1", "--seed", "7"]
        else:
            args = ["oneshot", "--model", str(model_dirs["dense"]), "--recipe", str(recipe),
                    "--output-dir", str(tmp_path / f"out{run}"), "--samples", "2",
                    "--seq-len", "16", "--seed", "7"]
        assert main(args) == 0
    torch.manual_seed(7)
    assert draws == [torch.randint(0, 2**31, (4,)).tolist()] * 2
