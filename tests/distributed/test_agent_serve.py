"""``python -m earl_megatron.serve`` as a user runs it: a checkpoint served over OpenAI's chat
completions API, driven by the ``openai`` package (plain, streamed, async), the request's seed
and temperature honoured (the same seed gives the same text, greedy is greedy), the sampled ids
in the answer, and Ctrl-C (SIGINT) ending the server with exit 0.

The checkpoint is a tiny random Llama saved by transformers with the character tokenizer, so
the test reads the way a user serves an HF checkpoint: ``run.init=DIR``."""

import asyncio
import signal

import pytest

from earl_megatron.testing.agents import serve_process

MSGS = [{"role": "user", "content": "say hi"}]


def _export(out) -> None:
    """A tiny random Llama in HF form with the character tokenizer and its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from earl_megatron.rollout.tokenizer import char_tokenizer

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    char_tokenizer().save_pretrained(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf = str(tmp_path_factory.mktemp("serve") / "hf")
    _export(hf)
    proc, url = serve_process(f"run.init={hf}", "rollout.max_action_tokens=8",
                              f"run.output_dir={tmp_path_factory.mktemp('serve_run')}")
    yield proc, url
    if proc.poll() is None:
        proc.kill()


def test_openai_clients_sample_from_the_served_checkpoint(served):
    from openai import AsyncOpenAI, OpenAI

    proc, url = served
    client = OpenAI(base_url=url, api_key="test-key", max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]
    a = client.chat.completions.create(model="policy", messages=MSGS, seed=7, max_tokens=6)
    b = client.chat.completions.create(model="policy", messages=MSGS, seed=7, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    ids = a.choices[0].model_extra["token_ids"]
    assert 1 <= len(ids) <= 6 and a.usage.completion_tokens == len(ids)
    assert a.choices[0].finish_reason in ("stop", "length")
    g1, g2 = (client.chat.completions.create(model="policy", messages=MSGS, temperature=0)
              for _ in range(2))
    assert g1.choices[0].model_extra["token_ids"] == g2.choices[0].model_extra["token_ids"]
    chunks = list(client.chat.completions.create(model="policy", messages=MSGS, seed=7,
                                                 max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content and chunks[-1].usage.completion_tokens == len(ids)

    async def two():
        aclient = AsyncOpenAI(base_url=url, api_key="test-key", max_retries=0)
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="policy", messages=MSGS, temperature=0) for _ in range(2)))

    r1, r2 = asyncio.run(two())   # concurrent requests: one batch, the same greedy answer
    assert r1.choices[0].message.content == r2.choices[0].message.content == \
        g1.choices[0].message.content
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
