"""LoraSpec's validation and the adapter's tp slicing rule (single process, no model)."""

import pytest
import torch

from earl_megatron.models.lora import TARGETS, LoraSpec, _slice, _unslice


def test_spec_defaults_and_scaling():
    spec = LoraSpec(rank=8, alpha=16)
    assert spec.targets == TARGETS
    assert spec.dropout == 0.0
    assert spec.scaling == 2.0
    # a list is kept as a tuple (the spec stays hashable and frozen)
    assert LoraSpec(rank=4, alpha=4, targets=["linear_qkv"]).targets == ("linear_qkv",)
    assert LoraSpec(rank=4, alpha=4, targets="linear_fc2").targets == ("linear_fc2",)


@pytest.mark.parametrize("kwargs,words", [
    (dict(rank=0, alpha=8), "lora rank 0"),
    (dict(rank=2.5, alpha=8), "positive integer"),
    (dict(rank=True, alpha=8), "lora rank True"),
    (dict(rank=8, alpha=0), "lora alpha 0"),
    (dict(rank=8, alpha=float("nan")), "positive number"),
    (dict(rank=8, alpha=8, dropout=1.0), "lora dropout 1.0"),
    (dict(rank=8, alpha=8, dropout=-0.1), "[0, 1)"),
    (dict(rank=8, alpha=8, targets=("q_proj",)), "['q_proj'] unknown"),
    (dict(rank=8, alpha=8, targets=()), "targets empty"),
    (dict(rank=8, alpha=8, targets=("linear_qkv", "linear_qkv")), "repeat"),
])
def test_spec_refuses_bad_values_naming_them(kwargs, words):
    with pytest.raises(ValueError) as e:
        LoraSpec(**kwargs)
    assert words in str(e.value)


def test_slice_follows_megatron_partition_stride():
    full = torch.arange(8.0).unsqueeze(1)           # rows 0..7, e.g. SwiGLU fc1's [gate; up]
    # stride 2 on tp 2: rank r holds [gate_r; up_r] = chunks r and r + 2 of 4
    assert _slice(full, 0, 2, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert _slice(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert _slice(full, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    cols = torch.arange(12.0).reshape(2, 6)
    assert _slice(cols, 1, 1, 2, 3).tolist() == [[4, 5], [10, 11]]
    for dim, stride, tp, t in [(0, 2, 2, full), (0, 1, 4, full), (1, 1, 3, cols)]:
        parts = [_slice(t, dim, stride, r, tp) for r in range(tp)]
        assert torch.equal(_unslice(parts, dim, stride), t)
