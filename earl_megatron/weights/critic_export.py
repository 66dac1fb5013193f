"""PPO's critic out to Hugging Face: a token-classification model with one label, the value.

    earl convert mcore-to-hf runs/RUN/checkpoints/iter_N OUT --critic

The critic (models/value_model.py) is the policy's trunk, untied, with ``value_head`` (an
``nn.Linear(hidden, 1)`` with a bias, after the final norm) where GPTModel's output layer was.
transformers' ``<Family>ForTokenClassification`` (Llama, Qwen2, Qwen3, Qwen3-MoE) is the same
function: ``model.*`` (the trunk, the causal LM's names) and ``score`` (a Linear over the final
norm's output, bias on by default), so ``AutoModelForTokenClassification.from_pretrained(OUT)``
gives ``logits[..., 0]`` = the critic's values, position t the value of the context up to and
including token t (rl/value.py's alignment).

Where the critic is read from: ``src/critic/`` (a training checkpoint's, written by
trainer/critic.save_critic; the model config beside it in ``src``), or ``src`` itself when it
holds the value head (``iter_N/critic`` given directly: the config from its parent, or a critic
saved on its own with its config). Invariants: the trunk goes through the policy's own export
(weights/convert.py, every tensor bit-exact, dtype kept); the head is written as stored; the
config is the policy's HF config (``hf/config.json`` when the run had one) with the
architecture, ``num_labels=1`` and untied embeddings; ``classifier_dropout`` is 0 (the critic
trains without dropout).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from earl_megatron.runtime.checkpoint import CONFIG_JSON, CRITIC_DIR, HF_SUBDIR
from earl_megatron.runtime.io_errors import CheckpointError, new_output_dir, reading
from earl_megatron.weights import dcp_parts as dcp
from earl_megatron.weights import hf_mapping as hfm
from earl_megatron.weights.hf_io import HFWriter, tokenizer_copies

HEAD = {"value_head.weight": "score.weight", "value_head.bias": "score.bias"}
"""The value head's checkpoint keys (models/value_model.HEAD_KEY) -> the HF model's names."""
LABEL = "value"


def trunk_rules(ccfg) -> tuple:
    """The tensor table's rows of the critic ``ccfg``'s trunk: every row with HF sources but the
    value head's (``output_layer.*``: ``score.*`` in HF, read and written apart)."""
    return tuple(r for r in hfm.rules(ccfg) if not r.name.startswith("output_layer."))


def critic_source(src: str | Path) -> tuple[Path, Path, dict]:
    """(the directory holding the critic's tensors, the directory holding its model config, the
    tensors' DCP metadata) for a training checkpoint, its ``critic/`` or a critic saved with its
    config; a clear error for anything else."""
    found = find_critic(src)
    if found is None:
        raise CheckpointError(f"{src} holds no critic ({CRITIC_DIR}/ with value_head.* "
                              "tensors): it was written by a run without algorithm.name=ppo; "
                              "drop --critic to export the policy")
    return found


def find_critic(src: str | Path) -> Optional[tuple[Path, Path, dict]]:
    """``critic_source``'s answer, or None where ``src`` holds no critic at all; a critic
    without a model config beside it or in its parent is refused."""
    src = Path(src)
    for tensors in (src / CRITIC_DIR, src):
        stored = _stored(tensors) if (tensors / "metadata.json").is_file() else {}
        if all(k in stored for k in HEAD):
            for config in (tensors, tensors.parent):
                if (config / CONFIG_JSON).is_file():
                    return tensors, config, stored
            raise CheckpointError(f"{tensors} holds a critic but no {CONFIG_JSON} beside it or "
                                  "in its parent; give the whole checkpoint directory "
                                  "(runs/RUN/checkpoints/iter_N)")
    return None


def _stored(path: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    with reading(path):
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata


def value_model_config(cfg, base: Optional[dict]) -> dict:
    """The HF config.json of the critic of policy config ``cfg`` (``base``: the run's original
    HF config, whose other keys are kept)."""
    from earl_megatron.models.value_model import critic_config

    out = hfm.to_hf_config(critic_config(cfg), base)
    arch = out["architectures"][0]
    out.update(architectures=[arch.replace("ForCausalLM", "ForTokenClassification")],
               num_labels=1, id2label={"0": LABEL}, label2id={LABEL: 0},
               classifier_dropout=0.0, tie_word_embeddings=False)
    return out


def convert_critic_to_hf(src: str | Path, out_dir: str | Path, *, part_bytes: int = 256 << 20,
                         max_shard_bytes: int = 2 << 30,
                         tokenizer_from: Optional[str | Path] = None, progress: bool = False):
    """A checkpoint's critic -> an HF token-classification directory (config.json, safetensors,
    tokenizer files): ``ConversionStats``."""
    from earl_megatron.models.value_model import critic_config
    from earl_megatron.weights import convert as cv

    t0 = time.perf_counter()
    tensors, config_dir, stored = critic_source(src)
    with reading(config_dir):
        cfg = cv.read_model_config(config_dir)
        base_path = config_dir / HF_SUBDIR / "config.json"
        base = json.loads(base_path.read_text()) if base_path.is_file() else None
    ccfg = critic_config(cfg)
    extra, copy = tokenizer_copies(config_dir / HF_SUBDIR, tokenizer_from)
    rules = trunk_rules(ccfg)
    with cv.conversion_process(ccfg):
        template = cv.sharded_template(ccfg)
    head = {name: (name, tuple(stored[name].size)) for name in HEAD}
    for name, region in [(r.name, cv.region_of(template[r.name])) for r in rules] + \
            list(head.items()):
        dcp.region_request(region, name, stored, tensors)
    with new_output_dir(out_dir, inputs=[tensors] + ([extra] if tokenizer_from else [])) as out, \
            reading(tensors):
        writer = HFWriter(out, max_shard_bytes=max_shard_bytes)
        n_parts = cv.mcore_to_hf_parts(tensors, ccfg, template, stored, writer, part_bytes,
                                       progress, {}, rules=rules)
        for part in dcp.read_groups(tensors, stored, [head], part_bytes):
            for name, t in part[0].items():
                writer.add(HEAD[name], t)
        writer.finish(value_model_config(cfg, base), copy)
    return cv.ConversionStats(len(rules) + len(HEAD), writer.total_bytes,
                              time.perf_counter() - t0, n_parts + 1)

