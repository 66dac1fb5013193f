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
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    char_tokenizer().save_pretrained(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf = str(tmp_path_factory.mktemp("serve") / "hf")
    _export(hf)
    proc, url = serve_process(f"run.init={hf}", "rollout.max_action_tokens=4",
                              "rollout.agent_port=0", "rollout.agent_max_body_mb=0.01",
                              f"run.output_dir={tmp_path_factory.mktemp('serve_run')}",
                              module=("earl_megatron.cli", "serve"))
    yield proc, url, hf
    if proc.poll() is None:
        proc.kill()


def test_openai_clients_sample_from_the_served_checkpoint(served):
    from openai import AsyncOpenAI, OpenAI

    proc, url, _ = served
    client = OpenAI(base_url=url, api_key="test-key", max_retries=0)
    assert [m.id for m in client.models.list()] == ["policy"]
    a = client.chat.completions.create(model="policy", messages=MSGS, seed=7, max_tokens=6)
    b = client.chat.completions.create(model="policy", messages=MSGS, seed=7, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    ids = a.choices[0].model_extra["token_ids"]
    assert 1 <= len(ids) <= 6 and a.usage.completion_tokens == len(ids)
    assert a.choices[0].finish_reason in ("stop", "length")
    g1, g2 = (client.chat.completions.create(model="policy", messages=MSGS, temperature=0,
                                             max_tokens=12) for _ in range(2))
    assert g1.choices[0].model_extra["token_ids"] == g2.choices[0].model_extra["token_ids"]
    chunks = list(client.chat.completions.create(model="policy", messages=MSGS, seed=7,
                                                 max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content and chunks[-1].usage.completion_tokens == len(ids)

    async def two():
        aclient = AsyncOpenAI(base_url=url, api_key="test-key", max_retries=0)
        return await asyncio.gather(*(aclient.chat.completions.create(
            model="policy", messages=MSGS, temperature=0, max_tokens=12) for _ in range(2)))

    r1, r2 = asyncio.run(two())   # concurrent requests: one batch, the same greedy answer
    assert r1.choices[0].message.content == r2.choices[0].message.content == \
        g1.choices[0].message.content
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()


def test_the_api_as_openai_clients_use_it(served):
    """max_tokens above training's rollout.max_action_tokens (serve has no per-call cap),
    logprobs equal to the model's own (transformers, 1e-5), each tool_choice, n, a body over
    rollout.agent_max_body_mb (413); last, Ctrl-C."""
    import httpx
    import openai
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from earl_megatron.agents.chat import ChatRenderer

    proc, url, hf = served
    client = OpenAI(base_url=url, api_key="test-key", max_retries=0)
    r = client.chat.completions.create(model="policy", messages=MSGS, seed=1, max_tokens=20,
                                       logprobs=True)
    c = r.choices[0]
    ids = c.model_extra["token_ids"]
    assert len(ids) == 20 if c.finish_reason == "length" else len(ids) < 20   # not a silent 4
    assert [t.logprob for t in c.logprobs.content] and len(c.logprobs.content) == len(ids)
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    tok = AutoTokenizer.from_pretrained(hf)
    prompt = ChatRenderer(tok).encode(ChatRenderer(tok).messages_text(MSGS, None, True))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits.double(), -1)[torch.arange(len(ids)), torch.tensor(ids)]
    got = torch.tensor([t.logprob for t in c.logprobs.content], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="policy", messages=MSGS, tools=tools,
                                           tool_choice=choice, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert choice == "auto" or not r.choices[0].message.tool_calls
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError, match="does not constrain decoding"):
            client.chat.completions.create(model="policy", messages=MSGS, tools=tools,
                                           tool_choice=choice)
    r = client.chat.completions.create(model="policy", messages=MSGS, n=3, max_tokens=5, seed=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == sum(len(ch.model_extra["token_ids"])
                                            for ch in r.choices)
    assert len({tuple(ch.model_extra["token_ids"]) for ch in r.choices}) > 1   # three samples
    big = httpx.post(url + "/chat/completions", headers={"Authorization": "Bearer test-key"},
                     json={"messages": [{"role": "user", "content": "x" * 20_000}]})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
