"""Vision-language and dual-encoder configs on the command line: a unit with more than 64
leaves is laid out (numpy's meshgrid, which took one axis per leaf, allows 64), and a
model of several towers is refused in one line naming the towers to plan instead (CLIP
raised transformers' NotImplementedError)."""

import json
import shlex

import numpy as np
import pytest

from autopar.cli import main
from autopar.cost.layout_table import _combinations

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("sizes", [[2, 3, 1, 4], [3], [1, 2]])
def test_combinations_are_numpys_meshgrid_in_order(sizes):
    grids = np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij")
    assert np.array_equal(_combinations(sizes), np.stack([g.ravel() for g in grids], axis=1))


def test_combinations_of_more_than_64_choices():
    """101 choices, one of two options, the rest one: two rows (meshgrid refuses >64 axes)."""
    rows = _combinations([1] * 100 + [2])
    assert rows.shape == (2, 101) and rows[:, :100].max() == 0 and list(rows[:, 100]) == [0, 1]
    assert _combinations([]).shape == (1, 0)


def _plan(tmp_path, config: dict, extra: str, capsys) -> tuple[int, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = main(shlex.split(f"plan --model-config {path} --cluster dgx-h100:1 --global-batch-size 8 {extra}"))
    return code, capsys.readouterr().err


def test_a_vision_language_model_with_a_large_unit_plans(tmp_path, capsys):
    """Gemma 3's vision-language class at its default config: its first unit (the vision
    tower and the embeddings) holds over a hundred leaves; it plans, where it raised
    numpy's 'maximum supported dimension for an ndarray is currently 64, found 109'."""
    if not hasattr(transformers, "Gemma3ForConditionalGeneration"):
        pytest.skip("this transformers has no Gemma 3")
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    code, err = _plan(tmp_path, config, f"--seq-len 512 --out {tmp_path / 'plan.json'}", capsys)
    assert code == 0 and (tmp_path / "plan.json").exists(), err


def test_a_model_of_two_towers_is_refused_naming_them(tmp_path, capsys):
    code, err = _plan(tmp_path, {"model_type": "clip", "architectures": ["CLIPModel"]}, "--seq-len 77", capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (
        "autopar: error: CLIPModel (clip) has no single token embedding: it runs several towers on several inputs, "
        'and --model-config makes one kind of sample; plan one tower: its "text_config" with "model_type": '
        '"clip_text_model" and "architectures": ["CLIPTextModel"], or its "vision_config" with '
        '"model_type": "clip_vision_model" and "architectures": ["CLIPVisionModel"].'
    )
    code, err = _plan(
        tmp_path, {"model_type": "clip_text_model", "architectures": ["CLIPTextModel"]}, "--seq-len 77", capsys
    )
    assert code == 0, err
