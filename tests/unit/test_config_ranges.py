"""Bad values stop at construction with one ConfigError naming the key: every float of every
section is finite (nan and inf rejected, whichever section it is in), every count >= 1 before
anything divides by it, the model's divisibility; and ``train.validate`` names the environment's
kwargs and the files a run reads (sft.data, the tokenizer, run.init's architecture) before any
model or group exists."""

import dataclasses
import json
import math
import typing

import pytest

from earl_megatron.config.model import ModelConfig
from earl_megatron.config.sft import SFTConfig
from earl_megatron.config.train import ConfigError, TrainConfig

NAN, INF = float("nan"), float("inf")


def _float_keys() -> list[tuple[str, str]]:
    """(section, field) of every float or Optional[float] field of every section."""
    keys = []
    for sec in dataclasses.fields(TrainConfig):
        cls = typing.get_type_hints(TrainConfig)[sec.name]
        for name, tp in typing.get_type_hints(cls).items():
            if tp is float or tp == typing.Optional[float]:
                keys.append((sec.name, name))
    return keys


def test_every_float_key_is_found():
    keys = _float_keys()
    # the ones issue #24 found accepted silently, and one of each section that has floats
    for key in [("algorithm", "lr"), ("rollout", "temperature"), ("model", "rotary_base"),
                ("sft", "lr"), ("layout", "hysteresis"), ("cluster", "inter_node_gbps")]:
        assert key in keys
    assert len(keys) >= 20


@pytest.mark.parametrize("section, key", _float_keys())
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_every_float_rejects_nan_and_inf(section, key, bad):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({section: {key: bad}})
    assert str(e.value) == f"{section}.{key}={bad} must be a finite number"


def test_finite_checked_on_direct_construction_too():
    from earl_megatron.config.train import AlgorithmConfig, RolloutConfig

    with pytest.raises(ConfigError, match=r"^algorithm\.lr=nan must be a finite number$"):
        TrainConfig(algorithm=AlgorithmConfig(lr=NAN))
    with pytest.raises(ConfigError, match=r"^rollout\.temperature=inf must be"):
        TrainConfig(rollout=RolloutConfig(temperature=INF))
    with pytest.raises(ConfigError, match=r"^model\.norm_epsilon=nan must be"):
        ModelConfig(norm_epsilon=NAN)
    with pytest.raises(ConfigError, match=r"^sft\.lr=inf must be"):
        SFTConfig(lr=INF)


BAD = [  # (overrides, the whole message)
    ({"model": {"num_layers": -3}}, "model.num_layers=-3 must be >= 1"),
    ({"model": {"vocab_size": 0}}, "model.vocab_size=0 must be >= 1"),
    ({"model": {"num_query_groups": 0}}, "model.num_query_groups=0 must be >= 1"),
    ({"model": {"num_attention_heads": 0}}, "model.num_attention_heads=0 must be >= 1"),
    ({"model": {"hidden_size": 0}}, "model.hidden_size=0 must be >= 1"),
    ({"model": {"ffn_hidden_size": -1}}, "model.ffn_hidden_size=-1 must be >= 1"),
    ({"model": {"max_position_embeddings": 0}}, "model.max_position_embeddings=0 must be >= 1"),
    ({"model": {"kv_channels": 0}}, "model.kv_channels=0 must be >= 1"),
    ({"model": {"rotary_base": 0.0}}, "model.rotary_base=0.0 must be > 0"),
    ({"model": {"norm_epsilon": -1e-6}}, "model.norm_epsilon=-1e-06 must be > 0"),
    ({"model": {"num_query_groups": 3}},
     "model.num_attention_heads=8 must be a multiple of model.num_query_groups=3"),
    ({"model": {"hidden_size": 60}},
     "model.hidden_size=60 must divide by model.num_attention_heads=8 (or set model.kv_channels)"),
    ({"model": {"family": "gpt2"}},
     "model.family='gpt2' is not a known family; supported: ('llama', 'qwen2', 'qwen3', 'qwen3_moe')"),
    ({"model": {"params_dtype": "int8"}},
     "model.params_dtype='int8': use float32, bfloat16 or float16"),
    ({"sft": {"batch_size": 0}}, "sft.batch_size=0 must be >= 1"),
    ({"sft": {"expert_episodes": 0}}, "sft.expert_episodes=0 must be >= 1"),
    ({"sft": {"steps": -1}}, "sft.steps=-1: use 0 (no warm start) or more"),
    ({"sft": {"lr": 0.0}}, "sft.lr=0.0 must be > 0 (or null: algorithm.lr)"),
    ({"algorithm": {"lr": NAN}}, "algorithm.lr=nan must be a finite number"),
    ({"rollout": {"temperature": NAN}}, "rollout.temperature=nan must be a finite number"),
    ({"algorithm": {"off_policy_cap": INF, "off_policy": "tis", "old_logprobs": "recompute"}},
     "algorithm.off_policy_cap=inf must be a finite number"),
    ({"algorithm": {"max_staleness": -1}}, "algorithm.max_staleness=-1 must be >= 0 (0: "
                                           "synchronous)"),
    ({"rollout": {"env_concurrency": 0}}, "rollout.env_concurrency=0 must be >= 1"),
    ({"algorithm": {"tis_cap": 2.0}}, "algorithm.tis_cap was replaced: use "
     "algorithm.off_policy=tis algorithm.off_policy_cap=<cap> (with algorithm.old_logprobs="
     "recompute), or off_policy=decoupled"),
    ({"run": {"iterations": -1}}, "run.iterations=-1 must be >= 0"),
    ({"rollout": {"max_turns": 0}}, "rollout.max_turns=0 must be >= 1"),
    # names that say what trains, and knobs that would do nothing in the mode chosen
    ({"algorithm": {"name": "grpo", "group_size": 4, "gamma": 0.9}},
     "algorithm.gamma=0.9 does nothing under algorithm.name=grpo (it scores whole episodes, "
     "no per-turn returns): drop it, or use algorithm.name=reinforce_pp or ppo"),
    ({"cluster": {"inter_node_gbps": 100.0}},
     "cluster.inter_node_gbps=100.0 does nothing under cluster.preset=cpu (one host, no network "
     "between ranks): drop it, or use cluster=h100"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[m.split("=")[0] for _, m in BAD])
def test_bad_value_is_one_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(overrides)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_model_config_errors_are_config_errors_everywhere_it_is_built():
    # ModelConfig is also built from HF configs (weights/hf_mapping.py) and checkpoints: the
    # same ConfigError (a ValueError, so `except ValueError` callers are unchanged)
    with pytest.raises(ConfigError, match="model.num_query_groups=0"):
        ModelConfig(num_query_groups=0)
    assert issubclass(ConfigError, ValueError)
    assert math.isfinite(ModelConfig().rotary_base)


# ------------------------------------------------------------------ validate: the files a run reads
def _validate(overrides: dict) -> str:
    from earl_megatron.train import validate
    try:
        validate(TrainConfig.from_dict(overrides), 1)
    except ConfigError as e:
        return f"ConfigError: {e}"
    return "no error"


def _hf_dir(path, arch: str, **extra):
    path.mkdir(parents=True)
    cfg = {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4,
           "vocab_size": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
           **extra}
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_validate_names_missing_and_bad_input_files(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    (tmp_path / "empty").mkdir()
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    sft = {"steps": 2, "batch_size": 1}
    cases = {
        "env_kwarg": ({"env": {"kwargs": {"oponent": "mcts"}}},
                      "env.kwargs of env.name=connect_four: OpenSpielEnv.__init__() got an "
                      "unexpected keyword argument 'oponent'"),
        "env_value": ({"env": {"name": "calculator", "eval_opponents": [],
                               "kwargs": {"tool_timeout_s": 0}}},
                      "env.kwargs of env.name=calculator: tool_timeout_s=0 must be > 0"),
        "env_opponent": ({"env": {"eval_opponents": ["random", "alphazero"]}},
                         "env.eval_opponents=['random', 'alphazero'] of env.name=connect_four: "
                         "opponent 'alphazero': unknown opponent 'alphazero'"),
        "env_no_opponents": ({"env": {"name": "calculator"}},
                             "opponent 'random': CalculatorEnv.__init__() got an unexpected "
                             "keyword argument 'opponent' (an environment without opponents "
                             "takes env.eval_opponents=[])"),
        "sft_missing": ({"sft": {**sft, "data": str(tmp_path / "none.jsonl")}},
                        f"sft.data={tmp_path}/none.jsonl is not a file; point sft.data at a "
                        "JSONL file"),
        "sft_dir": ({"sft": {**sft, "data": str(tmp_path)}}, f"sft.data={tmp_path} is not a file"),
        "sft_format": ({"sft": {**sft, "data": str(bad_jsonl)}}, f"sft.data={bad_jsonl}: "),
        "tok_missing": ({"rollout": {"tokenizer": str(tmp_path / "no-tok")}},
                        f"rollout.tokenizer={tmp_path}/no-tok is not a directory; use game, "
                        "ascii, tool or the model's HF directory"),
        "tok_empty": ({"rollout": {"tokenizer": str(tmp_path / "empty")}},
                      f"rollout.tokenizer={tmp_path}/empty holds no tokenizer file (none of "
                      "tokenizer.json, tokenizer_config.json"),
        "init_missing": ({"run": {"init": str(tmp_path / "no-model")}},
                         f"run.init={tmp_path}/no-model does not exist"),
        "init_arch": ({"run": {"init": _hf_dir(tmp_path / "mistral", "MistralForCausalLM")}},
                      f"run.init={tmp_path}/mistral: architecture MistralForCausalLM is not "
                      "supported; supported: ['LlamaForCausalLM', "),
        "init_moe": ({"run": {"init": _hf_dir(tmp_path / "moe", "Qwen2ForCausalLM",
                                             num_experts=8)}},
                     "Qwen2ForCausalLM with mixture of experts (only Qwen3MoeForCausalLM "
                     "converts) is not supported"),
        "init_other_model": ({"run": {"init": _hf_dir(tmp_path / "llama", "LlamaForCausalLM",
                                                     num_hidden_layers=2)}},
                             f"model.num_layers=4 does not match run.init={tmp_path}/llama, "
                             "whose model has num_layers=2: drop model.num_layers"),
    }
    for name, (overrides, says) in cases.items():
        got = _validate(overrides)
        assert got.startswith("ConfigError: ") and says in got, (name, got)
    # the matching model passes, and so does a sft.data file of the right format
    assert _validate({"env": {"name": "calculator", "eval_opponents": []}}) == "no error"
    assert _validate({"run": {"init": str(tmp_path / "llama")},
                      "model": {"num_layers": 2}}) == "no error"
    good = tmp_path / "good.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "compute 1+1"}, '
                    '{"role": "assistant", "content": "<answer>2</answer>"}]}\n')
    assert _validate({"sft": {**sft, "data": str(good)}}) == "no error"


def test_tokenizer_of_a_converted_checkpoint_is_found_in_its_hf_folder(tmp_path):
    from earl_megatron.train import tokenizer_dir

    (tmp_path / "ckpt" / "hf").mkdir(parents=True)
    (tmp_path / "ckpt" / "hf" / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(str(tmp_path / "ckpt")) == tmp_path / "ckpt" / "hf"
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "tokenizer_config.json").write_text("{}")
    assert tokenizer_dir(str(tmp_path / "hfdir")) == tmp_path / "hfdir"


def test_a_corrupt_tokenizer_directory_is_a_config_error(tmp_path):
    from earl_megatron.train import make_tokenizer

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("not json")
    cfg = TrainConfig.from_dict({"rollout": {"tokenizer": str(tmp_path / "tok")}})
    with pytest.raises(ConfigError, match=rf"^rollout.tokenizer={tmp_path}/tok: transformers "
                                          "cannot load a tokenizer from"):
        make_tokenizer(cfg)
