"""Routing replay's pure parts: the per-token route codes round-trip, and the config refuses
routing replay where there are no routes to replay (a dense model, the SGLang engine)."""

import pytest
import torch

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.rollout.routing_replay import decode, encode, route_specs, to_targets


def test_codes_round_trip_and_pad_with_a_valid_topk():
    g = torch.Generator().manual_seed(0)
    # Qwen3-30B-A3B's router: 128 experts, top 8; 48 layers
    routes = torch.stack([torch.randperm(128, generator=g)[:8] for _ in range(5 * 48)])
    routes = routes.view(5, 48, 8)
    coded = encode(routes, 128, length=7)
    assert [s.name for s in route_specs(48)] == sorted(coded, key=lambda n: int(n[7:]))
    back = torch.stack([decode(coded[f"routes_{layer}"], 128, 8) for layer in range(48)], 1)
    assert torch.equal(back[:5], routes)
    assert torch.equal(back[5:], torch.arange(8).expand(2, 48, 8))  # padding
    assert torch.equal(decode(torch.zeros(3, dtype=torch.long), 4, 2), torch.tensor([[0, 1]] * 3))
    with pytest.raises(ValueError, match="do not fit"):
        encode(routes, 128, length=4)


def test_targets_are_in_the_routers_token_order():
    # routes [b=2, s=3, layers=2, k=1]: the router flattens [s, b] s-major
    routes = torch.arange(12).view(2, 3, 2, 1)
    t = to_targets(routes, first_layer=1, num_local_layers=1)
    assert len(t) == 1 and t[0][:, 0].tolist() == [1, 7, 3, 9, 5, 11]


def test_routing_replay_needs_an_moe_model_and_the_embedded_engine():
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        TrainConfig.from_dict({"algorithm": {"routing_replay": True}})
    moe = {"family": "qwen3_moe", "num_experts": 4, "moe_ffn_hidden_size": 32,
           "moe_router_topk": 2}
    with pytest.raises(ConfigError, match="rollout.engine='sglang'"):
        TrainConfig.from_dict({"model": moe, "algorithm": {"routing_replay": True},
                               "rollout": {"engine": "sglang"}})
    assert TrainConfig.from_dict({"model": moe, "algorithm": {"routing_replay": True}}) \
        .algorithm.routing_replay
