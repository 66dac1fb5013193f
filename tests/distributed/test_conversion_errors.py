"""Bad input to the conversion tools, load_policy and checkpoint loading: each case is ONE line
naming the problem and the fix, exit status 2 (tools) or a CheckpointError (library), and no
partial output: the output folder is removed (or left empty when it existed empty), no
``part-*.safetensors.tmp`` survives, and a file the tool did not write is never overwritten.

One world-1 process runs every case (imports dominate: ~3 s): the tools' ``main`` in process
with stderr captured, on a tiny Qwen2 saved by transformers and converted once."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str, *argv: str) -> tuple[int, str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = mod.main([*argv, "--no-progress"])
    lines = [l for l in err.getvalue().splitlines() if l.startswith("error:")]
    return code, "\n".join(lines)


def _cases(root: str) -> dict:
    from earl_megatron.plan.layout import ParallelLayout
    from earl_megatron.runtime.build import build_on_layout
    from earl_megatron.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import load_policy, read_model_config

    r = Path(root)
    hf, mc = r / "hf", r / "mc"
    out: dict = {"convert": _tool("convert_hf_to_mcore", str(hf), str(mc), "--part-mb", "0.1")}

    def damaged(name: str, how) -> Path:
        d = r / name
        shutil.copytree(mc, d)
        how(d)
        return d

    # the last part's files: read last, so earlier HF shards are written before the failure
    last = sorted(p.name for p in mc.glob("*.distcp"))[-1]
    trunc = damaged("trunc", lambda d: open(d / last, "r+b").truncate(100))
    missing = damaged("missing", lambda d: (d / last).unlink())
    meta = damaged("meta", lambda d: open(d / ".metadata", "r+b").truncate(50))
    small = ["--part-mb", "0.05", "--shard-mb", "0.05"]
    out["trunc"] = _tool("convert_mcore_to_hf", str(trunc), str(r / "o_trunc"), *small)
    (r / "o_empty").mkdir()
    out["trunc_empty_out"] = _tool("convert_mcore_to_hf", str(trunc), str(r / "o_empty"), *small)
    out["missing"] = _tool("convert_mcore_to_hf", str(missing), str(r / "o_missing"))
    out["meta"] = _tool("convert_mcore_to_hf", str(meta), str(r / "o_meta"))
    out["into_ckpt"] = _tool("convert_mcore_to_hf", str(mc), str(mc / "hf"))
    out["ckpt_itself"] = _tool("convert_mcore_to_hf", str(mc), str(mc))
    (r / "other").mkdir()
    (r / "other" / "config.json").write_text('{"mine": 1}')
    out["other_config"] = _tool("convert_mcore_to_hf", str(mc), str(r / "other"))
    (r / "a_file").write_text("x")
    out["unwritable"] = _tool("convert_mcore_to_hf", str(mc), str(r / "a_file" / "sub"))
    out["no_ckpt"] = _tool("convert_mcore_to_hf", str(r / "nowhere"), str(r / "o_nowhere"))
    out["merged_no_lora"] = _tool("convert_mcore_to_hf", str(mc), str(r / "o_merged"), "--merged")
    out["no_critic"] = _tool("convert_mcore_to_hf", str(mc), str(r / "o_critic"), "--critic")
    out["critic_merged"] = _tool("convert_mcore_to_hf", str(mc), str(r / "o_critic"), "--critic",
                                 "--merged")
    # HF side
    bad_hf = r / "bad_hf"
    shutil.copytree(hf, bad_hf)
    st = bad_hf / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    out["hf_trunc"] = _tool("convert_hf_to_mcore", str(bad_hf), str(r / "o_hf"))
    out["hf_into_itself"] = _tool("convert_hf_to_mcore", str(hf), str(hf))
    out["hf_other_config"] = _tool("convert_hf_to_mcore", str(hf), str(r / "other"))
    garbled = r / "garbled_hf"
    shutil.copytree(hf, garbled)
    (garbled / "config.json").write_text("{not json")
    out["hf_garbled_config"] = _tool("convert_hf_to_mcore", str(garbled), str(r / "o_garbled"))
    # library: load_policy and a training checkpoint
    with cpu_backend():
        for key, path in (("load_policy_trunc", trunc), ("load_policy_missing", missing)):
            try:
                load_policy(str(path), ParallelLayout(), ddp=False)
                out[key] = "loaded"
            except CheckpointError as e:
                out[key] = str(e)
        mol = build_on_layout(read_model_config(mc), ParallelLayout(), ddp=False)
        ck = save_checkpoint(mol, r / "train", 0, {"iteration": 0})
        victim = sorted(ck.glob("*.distcp"))[-1]
        open(victim, "r+b").truncate(64)
        try:
            load_checkpoint(mol, ck)
            out["train_ckpt"] = "loaded"
        except CheckpointError as e:
            out["train_ckpt"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    root = tmp_path_factory.mktemp("conversion_errors")
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "hf")
    return root, run_distributed(_cases, 1, str(root), timeout=400)[0]


def _one_line(res, *words):
    code, err = res
    assert code == 2, res
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)


def _no_leftovers(root: Path):
    assert not list(root.rglob("*.safetensors.tmp"))
    assert not list(root.rglob(".parts"))


def test_conversion_itself_works(results):
    root, res = results
    assert res["convert"] == (0, "")
    assert (root / "mc" / "earl_model_config.json").is_file()


def test_damaged_checkpoints_are_one_line_and_leave_nothing(results):
    root, res = results
    _one_line(res["trunc"], "truncated or corrupt", "copy the checkpoint again")
    _one_line(res["missing"], "incomplete", "distcp")
    _one_line(res["meta"], "truncated or corrupt")
    for name in ("o_trunc", "o_missing", "o_meta"):
        assert not (root / name).exists(), name
    assert list((root / "o_empty").iterdir()) == []  # existed empty: left empty
    _one_line(res["trunc_empty_out"], "truncated or corrupt")
    _no_leftovers(root)


def test_output_folders_refused_and_nothing_overwritten(results):
    root, res = results
    _one_line(res["into_ckpt"], "is inside", "choose an output folder outside it")
    _one_line(res["ckpt_itself"], "choose an output folder outside it")
    _one_line(res["other_config"], "not empty", "config.json", "never overwritten")
    assert json.loads((root / "other" / "config.json").read_text()) == {"mine": 1}
    assert not list((root / "mc" / "hf").glob("*.safetensors"))
    _one_line(res["unwritable"], "cannot write the output folder", "writable location")
    _one_line(res["no_ckpt"], "not a converted checkpoint", "convert_hf_to_mcore")
    _one_line(res["merged_no_lora"], "--merged merges LoRA adapters", "drop --merged")
    assert not (root / "o_merged").exists()
    _one_line(res["no_critic"], "holds no critic", "algorithm.name=ppo", "drop --critic")
    _one_line(res["critic_merged"], "--critic exports the value model", "drop --merged")
    assert not (root / "o_critic").exists()
    _one_line(res["hf_into_itself"], "choose an output folder outside it")
    _one_line(res["hf_other_config"], "not empty")
    assert json.loads((root / "other" / "config.json").read_text()) == {"mine": 1}


def test_damaged_hf_input(results):
    root, res = results
    _one_line(res["hf_trunc"], "model.safetensors")
    _one_line(res["hf_garbled_config"], "not valid JSON", "config.json")
    assert not (root / "o_hf").exists() and not (root / "o_garbled").exists()
    _no_leftovers(root)


def test_load_policy_and_training_checkpoint_raise_one_line(results):
    _, res = results
    for key in ("load_policy_trunc", "load_policy_missing", "train_ckpt"):
        assert res[key] != "loaded", key
        assert "\n" not in res[key] and ("truncated" in res[key] or "incomplete" in res[key]), \
            res[key]
        assert "copy the checkpoint again" in res[key], res[key]
