"""`earl convert` shows its progress by default, also off a terminal (a log file, a pipe): a line
while it checks the model, one when the bytes start moving, one per tenth of its bytes, and a
last line whose byte count is the model's: the tensor bytes of the HF safetensors files read
(HF -> Megatron-Core) and of those written (Megatron-Core -> HF), counted from the files' own
headers. A tiny random Llama saved in several shards (no download)."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DONE = re.compile(r"^(.+): done: (\d+) bytes in [\d.]+ s \(.+/s\)$")
TENTH = re.compile(r"^(.+): [\d.]+ [KMG]?i?B of [\d.]+ [KMG]?i?B \((\d+)%\), elapsed \d\d:\d\d, "
                   r"eta (?:\d\d:\d\d|--:--)$")


def _tensor_bytes(folder: Path) -> int:
    """Sum of the tensors' byte ranges in every safetensors header of ``folder``."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        total += sum(e["data_offsets"][1] - e["data_offsets"][0]
                     for k, e in header.items() if k != "__metadata__")
    return total


def _earl(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "earl_megatron.cli", "convert", *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\x1b[" not in proc.stdout            # plain lines, no escape codes
    return proc.stdout.splitlines()


def _check(lines, what, total):
    mine = [l for l in lines if l.startswith(what + ": ")]
    assert mine[0].endswith("checking the model against Megatron-Core's keys and shapes")
    assert mine[1].endswith(" to go"), mine
    tenths = [int(m[2]) for m in map(TENTH.match, mine) if m]
    assert tenths == sorted(tenths) and len(tenths) == len(set(tenths)) >= 3, mine
    done = [m for m in map(DONE.match, mine) if m]
    assert len(done) == 1 and mine[-1] == done[0][0] and int(done[0][2]) == total, (mine, total)


def test_earl_convert_reports_the_models_bytes_both_ways(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    hf = tmp_path / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf, max_shard_size="150KB")
    assert len(list(hf.glob("*.safetensors"))) > 1
    lines = _earl("hf-to-mcore", str(hf), str(tmp_path / "mcore"), "--part-mb", "0.1")
    _check(lines, "HF -> Megatron-Core", _tensor_bytes(hf))
    assert any(re.match(r"HF -> Megatron-Core: merging \d+ part\(s\) into one checkpoint", l)
               for l in lines), lines
    assert lines[-1].startswith(f"wrote {tmp_path / 'mcore'}")
    back = tmp_path / "back"
    lines = _earl("mcore-to-hf", str(tmp_path / "mcore"), str(back), "--shard-mb", "0.2")
    _check(lines, "Megatron-Core -> HF", _tensor_bytes(back))
    assert _tensor_bytes(back) == _tensor_bytes(hf)
