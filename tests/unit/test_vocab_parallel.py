"""vocab_parallel_logprobs_and_entropy without a tp group: equals log_softmax and Categorical
entropy; gradients equal autograd through the reference math (and pass gradcheck). The TP>1
path is tested against these references in tests/distributed/test_logprobs.py."""

import pytest
import torch

from earl_megatron.rl.vocab_parallel import vocab_parallel_logprobs_and_entropy


def _reference(logits, labels, temperature=1.0):
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = torch.distributions.Categorical(logits=z).entropy()
    return logp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_and_categorical_entropy(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=g) * 4 + 30.0  # large offset: needs the max shift
    labels = torch.randint(0, 64, (3, 5), generator=g)
    logp, ent = vocab_parallel_logprobs_and_entropy(logits, labels, None,
                                                    temperature=temperature)
    ref_logp, ref_ent = _reference(logits, labels, temperature)
    assert logp.dtype == torch.float32 and logp.shape == (3, 5)
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradients_match_autograd_reference(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 32, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 32, (2, 7), generator=g)
    wa, wh = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)

    x = logits.clone().requires_grad_(True)
    logp, ent = vocab_parallel_logprobs_and_entropy(x, labels, None, temperature=temperature)
    (wa * logp + wh * ent).sum().backward()

    y = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = _reference(y, labels, temperature)
    (wa * ref_logp + wh * ref_ent).sum().backward()
    assert x.grad.dtype == torch.float64
    assert (x.grad - y.grad).abs().max() < 1e-6


def test_only_one_output_used():
    logits = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.arange(4)
    _, ent = vocab_parallel_logprobs_and_entropy(logits, labels)
    ent.sum().backward()
    y = logits.detach().clone().requires_grad_(True)
    _reference(y, labels)[1].sum().backward()
    assert (logits.grad - y.grad).abs().max() < 1e-9


def test_rejects_mismatched_shapes_and_bad_temperature():
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_logprobs_and_entropy(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_and_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long),
                                            temperature=0.0)


def test_gradcheck():
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (3, 4))
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs_and_entropy(x, labels, None, temperature=1.3),
        (logits,))
