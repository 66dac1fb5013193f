"""The SGLang timeouts as one budget (issue #24, item 6), pure: the config refuses a budget in
which a collective would give up before the restart logic does (docs/trainer.md, Timeouts)."""

from __future__ import annotations

import pytest

from earl_megatron.config.cluster import ClusterConfig
from earl_megatron.config.train import ConfigError, TrainConfig


def test_defaults_leave_the_restart_logic_inside_the_collective_timeout():
    c = ClusterConfig()
    # 3 requests of 300 s + 2 restarts of (300 s start + 120 s weight sync)
    assert c.server_recovery_s == 3 * 300 + 2 * (300 + 120) == 1740
    assert c.server_recovery_s < c.collective_timeout_s == 1800


@pytest.mark.parametrize("overrides,worst", [
    ({"server_start_timeout_s": 600}, 3 * 300 + 2 * (600 + 120)),
    ({"server_max_restarts": 3}, 4 * 300 + 3 * (300 + 120)),
    ({"collective_timeout_s": 1000}, 1740),
])
def test_a_budget_past_the_collective_timeout_is_refused_naming_the_keys(overrides, worst):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"cluster": overrides})
    msg = str(err.value)
    assert "cluster.collective_timeout_s" in msg and f"= {worst} s" in msg
    for key in ("server_max_restarts", "server_request_timeout_s", "server_start_timeout_s",
                "weight_sync_timeout_s"):
        assert key in msg


def test_raising_the_collective_timeout_admits_a_longer_budget():
    c = TrainConfig.from_dict({"cluster": {"server_start_timeout_s": 900,
                                           "collective_timeout_s": 4000}}).cluster
    assert c.server_recovery_s == 3 * 300 + 2 * (900 + 120) < 4000


@pytest.mark.parametrize("key", ["server_start_timeout_s", "server_request_timeout_s",
                                 "weight_sync_timeout_s"])
def test_timeouts_must_be_positive(key):
    with pytest.raises(ConfigError, match=f"cluster.{key}=0"):
        TrainConfig.from_dict({"cluster": {key: 0}})
    with pytest.raises(ConfigError, match="server_max_restarts"):
        TrainConfig.from_dict({"cluster": {"server_max_restarts": -1}})
