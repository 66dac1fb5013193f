"""Routing replay's pure parts: the per-token route codes round-trip; an episode keeps the
routes of the tokens it already fed when a later turn re-prefills them; the episode pool's
checkpoint state carries every episode's routes exactly; and the config refuses routing replay
where there are no routes to replay (a dense model, the SGLang engine), and allows it with
episodes in flight (algorithm.max_staleness >= 1)."""

import json

import pytest
import torch

from earl_megatron.config.train import ConfigError, TrainConfig
from earl_megatron.models.routing_replay import decode, encode, route_specs, to_targets
from earl_megatron.rollout import routing_replay as rollout_routes


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
    # episodes in flight keep their experts in the pool's state: asynchronous RL composes
    k1 = TrainConfig.from_dict({"model": moe, "algorithm": {
        "routing_replay": True, "max_staleness": 1, "off_policy": "decoupled",
        "old_logprobs": "recompute"}})
    assert k1.algorithm.routing_replay and k1.algorithm.max_staleness == 1


def _routes(n, seed, layers=3, topk=2, experts=4):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:topk]
                        for _ in range(n * layers)]).view(n, layers, topk).to(torch.int16)


def test_a_later_turn_keeps_the_routes_of_tokens_already_fed():
    first = _routes(5, 0)                  # turn 1 fed 5 tokens
    second = _routes(9, 1)                 # turn 2 re-prefilled them and fed 4 more
    assert not torch.equal(second[:5], first)
    got = rollout_routes.extend(first, second)
    assert torch.equal(got[:5], first) and torch.equal(got[5:], second[5:])
    assert got.dtype == torch.int16 and got.shape == (9, 3, 2)
    assert rollout_routes.extend(None, second) is second
    assert rollout_routes.extend(first, None) is None   # an engine without routes
    with pytest.raises(ValueError, match="do not extend"):
        rollout_routes.extend(second, first)


def test_the_pool_state_round_trip_keeps_every_episodes_routes_exactly():
    from earl_megatron.envs import make_env
    from earl_megatron.rollout.agent_loop import AgentLoopConfig, LiveEpisode, start_episode
    from earl_megatron.rollout.tokenizer import char_tokenizer
    from earl_megatron.trainer.episode_pool import Entry, EpisodePool, _to_json

    tok, loop = char_tokenizer(), AgentLoopConfig(max_turns=4, max_action_tokens=4)
    live = start_episode(make_env("connect_four"), 7, tok, loop, key=(1, 0))
    live.append([5, 6, 7], 1, [-0.5, -0.25, -0.125], version=1)
    live.actions.append("3")
    live.routes = _routes(len(live.tokens) - 1, 2)
    done = start_episode(make_env("connect_four"), 8, tok, loop, key=(1, 1))
    done.append([9, 9], 1, [-1.0, -2.0], version=0)
    done.routes = _routes(len(done.tokens) - 1, 3)
    finished = done.freeze("max_turns")
    entries = [dict(Entry((1, 0), 7, 2, live=live).portable(), replica=0),
               dict(Entry((1, 1), 8, 2, episode=finished).portable(), replica=1)]
    state = json.loads(json.dumps({"layout": "dp2", "entries": [_to_json(d) for d in entries]}))

    pool = EpisodePool("connect_four", {}, tok, loop, batch=4, group_size=2, max_staleness=1,
                       run_seed=0, env_concurrency=1)
    pool.restore(state)
    # the checkpoint's state, written again, unchanged
    assert json.loads(json.dumps(pool.state())) == state
    back = [pool._rebuild(d) for d in pool._restored]
    assert isinstance(back[0].live, LiveEpisode) and back[0].live.routes.dtype == torch.int16
    assert torch.equal(back[0].live.routes, live.routes)
    assert back[0].live.tokens == live.tokens and back[0].live.versions == live.versions
    assert torch.equal(back[1].episode.routes, finished.routes)
    assert back[1].episode == finished
    # a checkpoint written before routes travelled: its episodes restore with none
    old = json.loads(json.dumps(state))
    del old["entries"][0]["live"]["routes"], old["entries"][1]["episode"]["routes"]
    pool.restore(old)
    assert [d["live"] and d["live"]["routes"] for d in pool._restored] == [None, None]
    assert pool._restored[1]["episode"].routes is None
