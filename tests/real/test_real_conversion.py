"""HF <-> Megatron-Core conversion on the real SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV).

The tiny-model version is tests/distributed/test_conversion.py; this one runs the same converter
(weights/convert.py, which tools/convert_*.py wrap) on real weights and real chat text:

- world 1: HF -> Megatron-Core -> HF (both directions, in parts), then TP1 logits;
- world 2: PP2 and CP2 (the zigzag split of models/cp_attention.py), and TP2 refused before
  anything is built (9 heads / 3 KV groups: 2 divides neither);
- world 3: TP3 (one KV group and 3 heads per tp rank) and PP3.

Every layout loads both the converted checkpoint (dist_checkpointing resharding on load) and the
HF directory directly (each rank reads its own shards); logits must be within 1e-4 (fp32) of
transformers on the same directory. The exported HF directory must equal the source tensor by
tensor (bit-exact, same dtype). Tokens: 2 x 24 ids of two chat conversations rendered by the
model's own template. One launch per world size; the 538 MB model is read once per rank per
(path, layout), and by transformers once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from earl_megatron.testing.multiproc import run_distributed

TOL = 1e-4
TIMEOUT = 420     # per launch; measured 12-58 s each at load average ~5 on 2 cores


def _megatron_logits(mol, tokens: torch.Tensor):
    """(positions, full-vocab logits [b, s_local, vocab]) on the last pp_stage's tp rank 0
    (None elsewhere); with cp > 1 this rank's zigzag positions (earl_megatron/testing/logits.py)."""
    from earl_megatron.testing.logits import megatron_logits

    return megatron_logits(mol, tokens)


def _load_layouts(paths: list[str], layouts: list[str], tokens: torch.Tensor,
                  refuse: str | None = None) -> dict:
    """{(path, layout): (positions, logits)} on the ranks that hold them; ``refuse``: a layout
    whose InvalidLayoutError message is returned under "refused"."""
    import torch.distributed as dist

    from earl_megatron.plan.layout import InvalidLayoutError, ParallelLayout
    from earl_megatron.runtime import groups
    from earl_megatron.runtime.cpu_backend import cpu_backend
    from earl_megatron.weights.convert import load_policy

    out = {}
    with cpu_backend():
        for name in layouts:
            layout = ParallelLayout.parse(name, world_size=dist.get_world_size())
            for path in paths:
                mol = load_policy(path, layout, ddp=False)
                got = _megatron_logits(mol, tokens)
                if got is not None:
                    out[(path, str(layout))] = got
                del mol
                groups.destroy_groups()
        if refuse is not None:
            try:
                load_policy(paths[0], ParallelLayout.parse(refuse,
                                                           world_size=dist.get_world_size()))
            except InvalidLayoutError as e:
                out["refused"] = str(e)
    return out


def _convert_and_load_tp1(hf_dir: str, mcore_dir: str, rt_dir: str, tokens: torch.Tensor):
    from earl_megatron.weights.convert import convert_hf_to_mcore, convert_mcore_to_hf

    # 128 MiB parts: several saves merged and several region reads on a 538 MB model
    to_mcore = convert_hf_to_mcore(hf_dir, mcore_dir, part_bytes=128 << 20)
    to_hf = convert_mcore_to_hf(mcore_dir, rt_dir, part_bytes=128 << 20)
    return (to_mcore, to_hf), _load_layouts([mcore_dir, hf_dir], ["tp1"], tokens)


@pytest.fixture(scope="module")
def real(smollm2_dir, scratch_dir, chat_tokens):
    """(paths, tokens, transformers logits, conversion stats, world-1 logits)."""
    from transformers import AutoModelForCausalLM

    tokens = chat_tokens
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(tokens).logits.float()
    del model
    paths = {"hf": str(smollm2_dir), "mcore": str(scratch_dir / "mcore"),
             "rt": str(scratch_dir / "roundtrip")}
    stats, logits = run_distributed(_convert_and_load_tp1, 1, paths["hf"], paths["mcore"],
                                    paths["rt"], tokens, timeout=TIMEOUT)[0]
    return paths, tokens, ref, stats, logits


def _check_all(real, results: list[dict], layouts: list[str], record) -> None:
    """Each (path, layout)'s logits, assembled over the ranks that returned them (cp ranks hold
    their zigzag positions), against transformers; the max abs diff recorded."""
    by_key: dict = {}
    for r in results:
        for k, v in r.items():
            by_key.setdefault(k, []).append(v)
    paths, _, ref, _, _ = real
    for lay in layouts:
        for kind in ("mcore", "hf"):
            parts = by_key.get((paths[kind], lay))
            assert parts, (kind, lay, sorted(str(k) for k in by_key))
            got = torch.full_like(ref, float("nan"))
            for pos, logits in parts:
                got[:, pos] = logits
            assert not got.isnan().any(), (kind, lay, "positions missing")
            diff = (got - ref).abs().max().item()
            record(f"conversion logits max|diff| {lay} ({kind})", diff)
            assert diff < TOL, (kind, lay, diff)


def test_tp1_logits_match_transformers(real, record):
    _, _, ref, (to_mcore, to_hf), logits = real
    _check_all(real, [logits], ["TP1"], record)
    assert to_mcore.parts > 1 and to_hf.parts > 1   # several saves merged, several reads
    assert to_mcore.bytes == to_hf.bytes > 500e6    # every byte of the 538 MB came back
    # the text's next tokens are predictable: the logits carry the model, not noise
    assert ref.softmax(-1).max(-1).values.mean() > 0.3


def test_round_trip_is_bit_exact(real, record):
    from safetensors.torch import load_file

    from earl_megatron.weights import hf_mapping as hfm

    hf_dir, rt_dir = Path(real[0]["hf"]), Path(real[0]["rt"])
    orig = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    back = {k: v for f in sorted(rt_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(orig) == sorted(back)
    unequal = [n for n, t in orig.items()
               if back[n].dtype != t.dtype or not torch.equal(back[n], t)]
    record("round trip: tensors bit-exact", f"{len(orig) - len(unequal)}/{len(orig)}")
    assert not unequal, unequal[:5]
    orig_cfg = json.loads((hf_dir / "config.json").read_text())
    back_cfg = json.loads((rt_dir / "config.json").read_text())
    assert hfm.from_hf_config(back_cfg) == hfm.from_hf_config(orig_cfg)
    for key in ("num_key_value_heads", "tie_word_embeddings", "architectures", "vocab_size",
                "rms_norm_eps"):
        assert back_cfg[key] == orig_cfg[key], key
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (rt_dir / name).read_bytes() == (hf_dir / name).read_bytes(), name


def test_pp2_cp2_logits_and_tp2_refused(real, record):
    paths, tokens = real[0], real[1]
    results = run_distributed(_load_layouts, 2, [paths["mcore"], paths["hf"]], ["pp2", "cp2"],
                              tokens, "tp2", timeout=TIMEOUT)
    _check_all(real, results, ["PP2", "CP2"], record)
    refused = results[0]["refused"]
    record("TP2 refused", refused)
    assert "tp=2 does not divide num_query_groups=3" in refused


def test_tp3_pp3_logits(real, record):
    paths, tokens = real[0], real[1]
    results = run_distributed(_load_layouts, 3, [paths["mcore"], paths["hf"]], ["tp3", "pp3"],
                              tokens, timeout=TIMEOUT)
    _check_all(real, results, ["TP3", "PP3"], record)
