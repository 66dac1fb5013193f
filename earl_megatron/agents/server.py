"""OpenAI's chat completions API over the rollout engine, one URL prefix per RL episode.

    POST {base}/v1/chat/completions     messages, tools, tool_choice (auto | none), temperature,
                                        top_p, max_tokens | max_completion_tokens, stop, seed,
                                        n, logprobs, stream (server-sent events)
    GET  {base}/v1/models               the one model served
    POST {base}/reward                  {"reward": float, "info": {...}}: the agent's own score
    base = <public URL>/episodes/<id>   (training: one unguessable id an episode)
    base = <public URL>                 (``serve``: each request stands alone)

Built on FastAPI and uvicorn (the pair SGLang and vLLM serve this API with), in a daemon thread
of the replica's leader rank; the handlers run on uvicorn's event loop and never block it: a
request's prompt goes to the Broker (agents/broker.py) and the handler awaits its Generation.

Each episode keeps its conversation in tokens (agents/trajectory.py: the prompt extends the
previous call's prompt and completion, or the episode forks); the response is built from the
sampled ids (content and ``tool_calls`` parsed in the model's own format, ``finish_reason``
"tool_calls" | "stop" | "length", ``usage``), and the ids themselves ride along in
``choices[0].token_ids`` (the server keeps them either way). A stream sends a chunk per token
as the engine samples it (agents/responses.py ``streamed``), recorded as an unstreamed one.

Refusals, in OpenAI's error shape ``{"error": {"message", "type", "code"}}``: a missing or wrong
key 401; an unknown episode 404, a finished one 410 (also a call whose completion arrives after
its episode closed: checked under ``AgentEpisode.guard``, nothing recorded); a body over
``max_body_bytes`` 413; malformed JSON or fields, or what cannot be honoured (agents/requests.py)
400; a prompt (plus max_tokens) over ``max_context_tokens`` 400 ``context_length_exceeded``;
max_tokens over training's per-call cap 400 ``max_tokens_exceeded``; the call after
``max_turns`` 400 ``max_turns_exceeded`` (the episode ends, finish reason "max_turns"); while
the trainer swaps weights (``pause``) 503 with Retry-After. Invariants: a refused request changes
no episode; a finished episode's rows never change again. The template and the tokenizer run in
worker threads, never on the event loop.
"""

# no "from __future__ import annotations": FastAPI reads the handlers' annotations (Request)
# at definition time, in app()'s scope
import asyncio
import json
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from earl_megatron.agents.broker import Broker
from earl_megatron.agents.chat import ChatRenderer, ChatRequestError
from earl_megatron.agents.requests import (completion_budget, logprobs_body, parse_request,
                                           stop_cut)
from earl_megatron.agents.responses import completion_body, streamed
from earl_megatron.agents.trajectory import EpisodeTokens
from earl_megatron.rollout.engine import SamplingParams

AGENTS_EXTRA = "pip install 'earl_megatron[agents]' (FastAPI, uvicorn, the openai client)"


@dataclass(frozen=True)
class ServerLimits:
    max_context_tokens: int
    max_action_tokens: Optional[int]
    """Training's per-call cap (rollout.max_action_tokens): a call without max_tokens samples
    up to it, one asking for more is refused (agents/requests.py); None (``serve``): the
    context is the only bound."""
    max_turns: int
    temperature: float = 1.0
    top_p: float = 1.0
    honour_sampling: bool = False
    """False (training): every call samples at the run's temperature and top_p, the policy the
    trainer scores (a client's own values are counted in ``sampling_overrides``); True
    (``serve``): the request's values are used."""


@dataclass
class AgentEpisode:
    """One episode's state on the server (mutated by its calls one at a time, under ``lock``,
    completions recorded under ``guard``; read by the trainer after ``close_episode``)."""

    id: str
    task: dict
    tokens: EpisodeTokens
    base_url: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    calls: int = 0
    tool_calls: int = 0
    malformed: int = 0
    sampling_overrides: int = 0
    finish_reason: str = ""
    posted: Optional[dict] = None
    """What the agent posted to {base}/reward."""
    last_messages: list = field(default_factory=list)
    """The latest request's messages plus the reply: the conversation as the agent saw it."""
    closed: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)
    """Held while a completion is recorded and while the episode closes: a completion that
    arrives after ``close_episode`` is refused (410), never recorded."""
    oldest: Optional[int] = None
    """The oldest version among its sampled tokens (None before one): trainer/agent_pool.py."""


def _error(status: int, message: str, code: str, kind: str = "invalid_request_error",
           headers: Optional[dict] = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": code,
                                   "param": None}}, status_code=status, headers=headers)


class AgentServer:
    """The endpoint (module docstring). ``start`` binds and serves; ``open_episode`` gives an
    agent its base URL; ``close_episode`` ends it (later calls 410)."""

    def __init__(self, tokenizer, broker: Broker, limits: ServerLimits, *,
                 host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
                 model_name: str = "policy", per_request_episodes: bool = False,
                 public_url: Optional[str] = None, max_body_bytes: int = 16 << 20):
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            raise ImportError(f"the agent endpoint needs FastAPI and uvicorn ({e}); "
                              f"{AGENTS_EXTRA}") from None
        self.renderer = ChatRenderer(tokenizer)
        self.broker, self.limits = broker, limits
        self.host, self.port = host, int(port)
        self.api_key = api_key or "earl-" + secrets.token_hex(16)
        self.model_name = model_name
        self.per_request = per_request_episodes
        self.public_url = public_url
        self.max_body_bytes = int(max_body_bytes)
        """A larger request body is refused with 413 (rollout.agent_max_body_mb)."""
        self.episodes: dict[str, AgentEpisode] = {}
        self.finished: set[str] = set()
        self.paused = False
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self.url = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"the agent endpoint cannot bind {self.host}:{self.port} ({e}); pick "
                          "another rollout.agent_port (0: any free port)") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.host}:"
                                   f"{self.port}")
            time.sleep(0.01)
        self.url = base_url(self.host, self.port, self.public_url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def pause(self) -> None:
        """Weights are being swapped: live episodes' calls get 503 + Retry-After."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    # ------------------------------------------------------------------ episodes
    def open_episode(self, task: dict) -> AgentEpisode:
        eid = secrets.token_urlsafe(18)
        ep = AgentEpisode(eid, dict(task), EpisodeTokens(self.renderer),
                          f"{self.url}/episodes/{eid}")
        self.episodes[eid] = ep
        self.broker.open_episodes += 1
        self.broker.poke()
        return ep

    def close_episode(self, ep: AgentEpisode) -> None:
        with ep.guard:
            ep.closed = True
        if self.episodes.pop(ep.id, None) is not None:
            self.finished.add(ep.id)
            self.broker.open_episodes -= 1
            self.broker.poke()

    # ------------------------------------------------------------------ the app
    def app(self):
        from fastapi import FastAPI, Request

        app = FastAPI(title="earl_megatron agent endpoint", docs_url=None, redoc_url=None,
                      openapi_url=None)

        @app.get("/v1/models")
        async def models_root(request: Request):
            return self._models(request)

        @app.get("/episodes/{eid}/v1/models")
        async def models(eid: str, request: Request):
            return self._episode(eid, request) or self._models(request)

        @app.post("/v1/chat/completions")
        async def chat_root(request: Request):
            if not self.per_request:
                return _error(404, "this endpoint serves episodes: use the base_url your "
                              "episode was given (/episodes/<id>/v1)", "not_found")
            refused = self._auth(request)
            if refused:
                return refused
            ep = AgentEpisode("serve", {}, EpisodeTokens(self.renderer), self.url)
            return await self._chat(ep, request)

        @app.post("/episodes/{eid}/v1/chat/completions")
        async def chat(eid: str, request: Request):
            refused = self._episode(eid, request)
            if refused:
                return refused
            if self.paused:
                return _error(503, "weights are being updated; retry shortly",
                              "weights_updating", "server_error", {"Retry-After": "1"})
            ep = self.episodes[eid]
            await ep.lock.acquire()
            answer = None   # a stream releases the lock itself, once its completion is recorded
            try:   # 410 when it closed while this call waited for the one before it
                answer = self._gone(eid) if ep.closed else \
                    await self._chat(ep, request, ep.lock.release)
                return answer
            finally:
                if not getattr(answer, "unlocks_later", False):
                    ep.lock.release()

        @app.post("/episodes/{eid}/reward")
        async def reward(eid: str, request: Request):
            refused = self._episode(eid, request)
            if refused:
                return refused
            body, refused = await self._json(request)
            if refused:
                return refused
            if not isinstance(body, dict) or not isinstance(body.get("reward"), (int, float)) \
                    or isinstance(body.get("reward"), bool):
                return _error(400, 'post {"reward": <number>, "info": {...}}', "invalid_reward")
            self.episodes[eid].posted = {"reward": float(body["reward"]),
                                         "info": dict(body.get("info") or {})}
            return {"ok": True}

        return app

    def _models(self, request):
        refused = self._auth(request)
        return refused or {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "earl"}]}

    def _auth(self, request):
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            return _error(401, "missing or wrong API key: send Authorization: Bearer <the "
                          "api_key your agent was given>", "invalid_api_key")
        return None

    def _episode(self, eid: str, request):
        refused = self._auth(request)
        if refused:
            return refused
        if eid in self.finished:
            return self._gone(eid)
        if eid not in self.episodes:
            return _error(404, f"no episode {eid} on this server", "episode_not_found")
        return None

    @staticmethod
    def _gone(eid: str):
        return _error(410, f"episode {eid} has finished; its agent may not call again",
                      "episode_finished")

    async def _json(self, request):
        """(the body's JSON or a ChatRequestError, None), or (None, a 413 response) past
        ``max_body_bytes`` (read no further than that)."""
        limit = self.max_body_bytes
        too_big = None, _error(413, f"the request body is over {limit} bytes "
                               "(rollout.agent_max_body_mb)", "request_too_large")
        if int(request.headers.get("content-length") or 0) > limit:
            return too_big
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                return too_big
        try:
            return json.loads(bytes(raw)), None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return ChatRequestError(f"the request body is not JSON ({e})"), None

    async def _chat(self, ep: AgentEpisode, request, unlock=None):
        body, refused = await self._json(request)
        if refused:
            return refused
        lim = self.limits
        try:
            req = parse_request(body, self.model_name, self.broker.max_batch)
        except ChatRequestError as e:
            return _error(400, str(e), "invalid_request")
        if ep.calls >= lim.max_turns:
            ep.finish_reason = "max_turns"
            if ep.id in self.episodes:
                self.close_episode(ep)
            return _error(400, f"the episode used its {lim.max_turns} calls "
                          "(rollout.max_turns); it has ended", "max_turns_exceeded")
        try:   # the template and the tokenizer run off the event loop
            prompt = await asyncio.to_thread(ep.tokens.prompt, req["messages"], req["tools"])
            max_new = completion_budget(req["max_tokens"], len(prompt.ids),
                                        lim.max_context_tokens, lim.max_action_tokens)
        except ChatRequestError as e:
            return _error(400, str(e), getattr(e, "code", "invalid_request"))
        if lim.honour_sampling:
            temperature, top_p = (lim.temperature if req["temperature"] is None else
                                  req["temperature"], lim.top_p if req["top_p"] is None else
                                  req["top_p"])
        else:
            temperature, top_p = lim.temperature, lim.top_p
            if req["temperature"] not in (None, lim.temperature) or \
                    req["top_p"] not in (None, lim.top_p):
                ep.sampling_overrides += 1
        params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new,
                                stop_token_ids=self.renderer.fmt.stop_token_ids,
                                seed=req["seed"] if lim.honour_sampling else None)
        cid = f"chatcmpl-{secrets.token_hex(12)}"
        if req["stream"]:
            return streamed(self, ep, prompt, req, params, cid, unlock)
        futs = [self.broker.submit(prompt.ids, params) for _ in range(req["n"])]
        got = await self._finish(ep, prompt, req, futs)
        return completion_body(cid, self.model_name, *got) if isinstance(got, tuple) else got

    async def _finish(self, ep: AgentEpisode, prompt, req: dict, futs):
        """(choices, usage) once every choice is decoded and recorded; else the refusal."""
        try:
            gens = [await asyncio.wrap_future(f) for f in futs]
        except Exception as e:  # noqa: BLE001 - the rollout ended under this request
            return _error(503, f"the rollout engine did not answer ({type(e).__name__}: {e})",
                          "engine_unavailable", "server_error", {"Retry-After": "1"})
        choices = await asyncio.to_thread(self._record, ep, prompt, req, futs, gens)
        if choices is None:   # the episode closed while the engine decoded: nothing recorded
            return self._gone(ep.id)
        n, m = len(prompt.ids), sum(len(c["ids"]) for c in choices)
        return choices, {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def _record(self, ep: AgentEpisode, prompt, req: dict, futs, gens) -> Optional[list]:
        """Each choice cut at its stop string and recorded on the episode (in a worker thread,
        under ``ep.guard``); None, recording nothing, when the episode has closed."""
        tok, choices, messages = self.renderer.tokenizer, [], []
        with ep.guard:
            if ep.closed:
                return None
            for fut, gen in zip(futs, gens, strict=True):
                ids, lps, finish = list(gen.token_ids), list(gen.logprobs), gen.finish_reason
                cut = 0
                found = stop_cut(tok, ids, req["stop"])
                if found:
                    k, cut = found
                    ids, lps, finish = ids[:k], lps[:k], "stop"
                version = fut.version   # the policy version that sampled them (broker.Answer)
                reply = ep.tokens.complete(prompt, ids, lps, finish, cut, version,
                                           parse_tools=req["tool_choice"] != "none")
                if ids and version >= 0:
                    ep.oldest = version if ep.oldest is None else min(ep.oldest, version)
                ep.tool_calls += len(reply.tool_calls)
                ep.malformed += reply.malformed
                message = {"role": "assistant", "content": reply.content}
                if reply.tool_calls:
                    message["tool_calls"] = [
                        {"id": c.id, "type": "function",
                         "function": {"name": c.name, "arguments": c.arguments}}
                        for c in reply.tool_calls]
                messages.append(message)
                choices.append({"message": message, "ids": ids,
                                "finish": "tool_calls" if reply.tool_calls else finish,
                                "logprobs": logprobs_body(tok, ids, lps) if req["logprobs"]
                                else None})
            ep.calls += 1
            ep.last_messages = list(req["messages"]) + messages[:1]
        return choices


def base_url(host: str, port: int, public_url: Optional[str]) -> str:
    """The URL agents are handed: ``public_url`` (rollout.agent_public_url, its ``{port}``
    replaced by the bound port) when given; else the host it listens on, and for a wildcard
    host (0.0.0.0, "") this machine's name, which other machines can resolve."""
    if public_url:
        return public_url.replace("{port}", str(port)).rstrip("/")
    shown = socket.getfqdn() if host in ("0.0.0.0", "", "::") else host
    return f"http://{shown}:{port}"
