"""Who may drive the servers, and what the client trusts (issue #24, item 5).

Without SGLang (always run): the command line carries no secret; a foreign HTTP server that
answers everything with 200 on the server's port is never taken for ours, and every retry
starts on a new port; the weight group's store listens on loopback only; fault points pause
exactly one claimant, and two arms of one point each pause their own. With a real server
(EARL_SGLANG_VENV): a request without the engine's key is refused (401), and requests never go
through http_proxy.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from earl_megatron.rollout.engine import SamplingParams
from earl_megatron.rollout.sglang_engine import SGLangConfig, SGLangEngine, SGLangServerError
from earl_megatron.rollout.sglang_launch import server_command
from earl_megatron.runtime import fault_points

pytestmark = pytest.mark.timeout(1800)

DEAD_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens, a proxied request fails

# A stranger on the port: answers every request 200 with JSON naming some other model, the way
# a leftover server or another user's process would.
FOREIGN_SERVER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def _ok(self):
        body = json.dumps({"served_model_name": "someone-else", "success": True}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    do_GET = do_POST = _ok
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_command_line_carries_identity_but_no_secret(tmp_path):
    cfg = SGLangConfig(python="/v/bin/python", model_path="/m", device="cpu",
                       api_key="s3cret", load_format="dummy")
    cmd = server_command(cfg, 0, 31000, "/m", served_name="earl-abc",
                         secrets_file="/d/server-0.secret.yaml", load_format="dummy")
    assert cmd[cmd.index("--served-model-name") + 1] == "earl-abc"
    assert cmd[cmd.index("--config") + 1] == "/d/server-0.secret.yaml"
    assert cmd[cmd.index("--load-format") + 1] == "dummy"
    assert not any("s3cret" in c for c in cmd)  # /proc/<pid>/cmdline is world-readable


def test_a_foreign_server_on_the_port_is_never_taken_for_ours(tmp_path, monkeypatch):
    """The stand-in 'sglang.launch_server' is a stranger answering 200 to everything: /health
    passes but /model_info cannot name this start's nonce, so each start fails, and each retry
    runs on a new port. http_proxy points nowhere: a proxied /health would never pass."""
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(FOREIGN_SERVER)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("http_proxy", DEAD_PROXY)
    monkeypatch.setenv("HTTP_PROXY", DEAD_PROXY)
    config = SGLangConfig(python=sys.executable, model_path=str(model), device="cpu",
                          max_restarts=2, startup_timeout_s=120,
                          env=(("PYTHONPATH", str(fake.parent)),), log_dir=str(tmp_path / "logs"))
    with pytest.raises(SGLangServerError, match="not as the server just started"):
        SGLangEngine(config)
    log = (tmp_path / "logs" / "server-0.log").read_text()
    ports = [int(p) for p in re.findall(r"start: .* --port (\d+)", log)]
    names = re.findall(r"--served-model-name (\S+)", log)
    assert len(ports) == 3 and len(set(ports)) == 3, ports  # first start + 2 retries
    assert len(set(names)) == 3  # a fresh identity per start
    secret = tmp_path / "logs" / "server-0.secret.yaml"
    assert secret.stat().st_mode & 0o077 == 0  # the key file: this user only
    assert (tmp_path / "logs" / "server-0.log").stat().st_mode & 0o077 == 0


def _listening_addresses(port: int) -> list[str]:
    """Local addresses with a LISTEN socket on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


def test_weight_group_store_listens_on_loopback_only():
    from datetime import timedelta

    import torch.distributed as dist

    from earl_megatron.rollout.sglang_weights import weight_update_listener

    sock = weight_update_listener("127.0.0.1")
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10),
                          master_listen_fd=sock.detach(), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=10))
    store.set("k", "v")
    assert client.get("k") == b"v"
    # 0100007F is 127.0.0.1 in /proc's byte order; every interface would be 00000000
    assert _listening_addresses(port) == ["0100007F"], _listening_addresses(port)


def test_fault_point_pauses_exactly_one_matching_claimant(tmp_path, monkeypatch):
    monkeypatch.setenv(fault_points.ENV, str(tmp_path))
    ident = fault_points.arm(tmp_path, "p", log_dir="a")
    passed: list[str] = []

    def reach(tag: str, log_dir: str) -> None:
        fault_points.fault_point("p", log_dir=log_dir, tag=tag)
        passed.append(tag)

    other = threading.Thread(target=reach, args=("other", "b"))  # does not match: never waits
    other.start()
    other.join(timeout=30)
    assert passed == ["other"]
    threads = [threading.Thread(target=reach, args=(f"t{i}", "a")) for i in range(3)]
    for t in threads:
        t.start()
    hit = fault_points.wait_hit(tmp_path, "p", ident, timeout_s=30)
    losers = sorted(f"t{i}" for i in range(3) if f"t{i}" != hit["tag"])
    done = threading.Event()
    for _ in range(600):  # the losers pass within 30 s; the claimant must not
        if len(passed) == 3 or done.wait(0.05):
            break
    assert sorted(passed) == sorted(["other"] + losers)
    fault_points.release(tmp_path, "p", ident)
    for t in threads:
        t.join(timeout=30)
    assert len(passed) == 4 and passed[-1] == hit["tag"]
    # two arms of one point at once (two servers struck in one stage): each pauses the
    # claimant its match names, whichever arrives first
    idents = {d: fault_points.arm(tmp_path, "p", log_dir=d) for d in ("b", "a")}
    threads = [threading.Thread(target=reach, args=(f"u{d}", d)) for d in ("a", "b")]
    for t in threads:
        t.start()
    hits = {d: fault_points.wait_hit(tmp_path, "p", i, timeout_s=30) for d, i in idents.items()}
    assert {d: h["tag"] for d, h in hits.items()} == {"a": "ua", "b": "ub"}
    assert len(passed) == 4  # both paused
    for d, i in idents.items():
        fault_points.release(tmp_path, "p", i)
    for t in threads:
        t.join(timeout=30)
    assert sorted(passed[4:]) == ["ua", "ub"] and not list(tmp_path.glob("p.*.arm"))


# -- against a real server --------------------------------------------------------------------
@pytest.fixture(scope="module")
def dummy_engine(sglang_python, tiny_models, tmp_path_factory):
    """A server started from config.json alone (--load-format dummy)."""
    cfg_dir = tmp_path_factory.mktemp("config-only")
    (cfg_dir / "config.json").write_text((tiny_models["a"] / "config.json").read_text())
    config = SGLangConfig(python=sglang_python, model_path=str(cfg_dir), device="cpu",
                          load_format="dummy", startup_timeout_s=600, request_timeout_s=120)
    with SGLangEngine(config) as eng:
        yield eng


@pytest.mark.sglang
def test_only_the_key_holder_drives_the_server_and_no_proxy_is_used(dummy_engine, tiny_models,
                                                                    references, monkeypatch):
    server = dummy_engine._servers[0]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for headers in ({}, {"Authorization": "Bearer guessed"}):
        req = urllib.request.Request(server.url + "/update_weights_from_disk",
                                     data=json.dumps({"model_path": "/tmp"}).encode(),
                                     headers={"Content-Type": "application/json", **headers})
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(req, timeout=60)
        assert refused.value.code == 401
    assert server.is_ours()
    monkeypatch.setenv("http_proxy", DEAD_PROXY)
    monkeypatch.setenv("HTTP_PROXY", DEAD_PROXY)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    # the dummy-started server takes real weights from disk, through no proxy
    dummy_engine.update_weights(tiny_models["a"])
    gen = dummy_engine.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_new_tokens=6))
    assert list(gen[0].token_ids) == references["a"].greedy([1, 5, 9], 6)[0]
