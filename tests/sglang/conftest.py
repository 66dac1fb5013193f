"""Fixtures for the opt-in SGLang tests: the venv's python, tiny HF models, a reference.

The server tests run only when EARL_SGLANG_VENV names a venv built with
tools/sglang_cpu/setup.sh (`make sglang`); otherwise they are skipped with the command that enables them.
The tiny models are random Llamas and one Qwen3 built from a config with transformers (no
download).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENABLE_HINT = ("run `make test-sglang` (builds the venv with tools/sglang_cpu/setup.sh when "
               "missing), or EARL_SGLANG_VENV=~/.cache/earl-sglang-cpu pytest tests/sglang")

# Config ids 2..33 are EOS for the served model: SGLang stops on them unless told otherwise,
# which exercises the engine's "continue past an EOS the caller did not ask for" path.
EOS_IDS = list(range(2, 34))


@pytest.fixture(scope="session")
def eos_ids() -> list[int]:
    return list(EOS_IDS)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    venv = os.environ.get("EARL_SGLANG_VENV")
    if not venv:
        pytest.skip(f"EARL_SGLANG_VENV is not set; to enable: {ENABLE_HINT}")
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"EARL_SGLANG_VENV={venv} has no bin/python; {ENABLE_HINT}")
    return str(python)


def build_tiny_llama(path: Path, seed: int) -> Path:
    """Random 2-layer Llama (vocab 128, hidden 64, 4 heads, 2 KV heads), float32, saved to path.

    initializer_range 0.2 (not 0.02) makes next-token distributions peaked, so greedy argmaxes
    are far from ties and a 1e-5 numerical difference cannot flip them.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1,
                      eos_token_id=EOS_IDS, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    return path


def build_tiny_qwen3(path: Path, seed: int) -> Path:
    """Random 2-layer Qwen3 with odd shapes: hidden 64, 4 heads of head_dim 24 (96 != 64), 2 KV
    heads, tied embeddings, q/k norm weights drawn around 1 (HF initialises them to 1) so they
    matter; float32, saved to path. Same vocab, EOS ids and peaked init as the Llamas."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-6,
                      bos_token_id=1, eos_token_id=EOS_IDS, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("sglang-models")
    return {"a": build_tiny_llama(root / "a", seed=1), "b": build_tiny_llama(root / "b", seed=2),
            "qwen3": build_tiny_qwen3(root / "qwen3", seed=3)}


class Reference:
    """transformers' fp32 forward of a saved model: greedy decode and teacher-forced logprobs."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def log_softmax(self, ids: list[int], temperature: float = 1.0):
        # One thread: next to a server's busy CPU threads, two OpenMP threads here ran ~15x
        # slower than one (measured on 2 cores).
        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)
        try:
            with self.torch.no_grad():
                logits = self.model(self.torch.tensor([ids])).logits[0].double()
        finally:
            self.torch.set_num_threads(threads)
        return self.torch.log_softmax(logits / temperature, dim=-1)

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """Greedy decode by full recompute (no KV cache), with log_softmax(logits) per token."""
        ids, out, lps = list(prompt), [], []
        for _ in range(n):
            lp = self.log_softmax(ids)[-1]
            tok = int(lp.argmax())
            out.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
        return out, lps

    def logprobs(self, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
        """log_softmax(logits / T) of each of ``tokens`` given prompt + the tokens before it."""
        lp = self.log_softmax(list(prompt) + list(tokens), temperature)
        start = len(prompt) - 1
        return [float(lp[start + k, t]) for k, t in enumerate(tokens)]


@pytest.fixture(scope="session")
def references(tiny_models) -> dict[str, Reference]:
    return {name: Reference(path) for name, path in tiny_models.items()}


@pytest.fixture
def run_dir():
    """A directory of the test's own: pytest's tmp_path keeps only the newest 3 sessions, and on
    a machine where others run pytest too, a run of several minutes lost its dir mid-run."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="earl-sglang-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def group_gone():
    """``group_gone(pgid)``: earl_megatron.testing.multiproc.process_group_gone (waits 30 s for
    init to reap SIGKILLed children): a group still there after the wait is a server that
    outlived the run."""
    from earl_megatron.testing.multiproc import process_group_gone

    return process_group_gone
