"""algorithm.critic.init's sources, told apart and checked in one process before any read
(weights/critic_import.py): an HF value model (token or sequence classification, one label) is
trunk and head; a causal LM is its trunk; a value model with several labels, or of another
architecture, is one line naming the fix."""

from dataclasses import replace

import pytest
import torch

from earl_megatron.models.sharding import reference_weights
from earl_megatron.models.value_model import critic_config
from earl_megatron.plan.layout import ParallelLayout
from earl_megatron.runtime.io_errors import CheckpointError
from earl_megatron.testing.tiny_models import tiny_model
from earl_megatron.weights.critic_import import critic_init, join_critic_init
from earl_megatron.weights.hf_io import write_hf_dir
from earl_megatron.weights.hf_mapping import to_hf, to_hf_config

POLICY = tiny_model("qwen2", vocab_size=64, num_layers=2)


def _write(path, cfg, arch, score_rows=1, bias=True):
    """An HF directory of ``cfg``'s trunk under ``arch``: a causal LM's head, or a ``score``
    of ``score_rows``."""
    causal = arch.endswith("ForCausalLM")
    hf_cfg = replace(critic_config(cfg), value_head=not causal)   # lm_head, or score.*
    tensors = to_hf(hf_cfg, reference_weights(hf_cfg, seed=7))
    if not causal:
        tensors["score.weight"] = torch.randn(score_rows, cfg.hidden_size)
        tensors["score.bias"] = torch.zeros(score_rows)
        if not bias:
            del tensors["score.bias"]
    config = {**to_hf_config(hf_cfg), "architectures": [arch]}
    write_hf_dir(path, tensors, config)
    return path


def test_value_models_give_trunk_and_head_and_causal_lms_are_policy_shaped(tmp_path):
    layout = ParallelLayout(tp=1)
    token = _write(tmp_path / "token", POLICY, "Qwen2ForTokenClassification")
    what, fill = critic_init(token, POLICY, layout)
    assert what == f"the value model {token} (Qwen2ForTokenClassification)" and callable(fill)
    reward = _write(tmp_path / "reward", POLICY, "Qwen2ForSequenceClassification", bias=False)
    assert critic_init(reward, POLICY, layout)[0].endswith("(Qwen2ForSequenceClassification)")
    causal = _write(tmp_path / "causal", POLICY, "Qwen2ForCausalLM")
    assert critic_init(causal, POLICY, layout)[0] == f"the trunk of the HF model {causal}"
    assert critic_init(tmp_path / "nowhere", POLICY, layout) is None   # load_policy's error
    # nothing for a rank without a critic to join but a trained critic's collective read
    assert join_critic_init(token) is True and join_critic_init(causal) is False


def test_a_value_model_that_is_not_the_policys_critic_is_refused(tmp_path):
    layout = ParallelLayout(tp=1)
    two = _write(tmp_path / "two", POLICY, "Qwen2ForTokenClassification", score_rows=2)
    with pytest.raises(CheckpointError, match=r"score.weight of shape \(2, 64\); the critic's "
                       r"head is one value .*give a value or reward model with one label"):
        critic_init(two, POLICY, layout)
    wider = _write(tmp_path / "wider", tiny_model("qwen2", vocab_size=64, num_layers=3),
                   "Qwen2ForTokenClassification")
    with pytest.raises(ValueError, match="holds another architecture than the policy's"):
        critic_init(wider, POLICY, layout)
