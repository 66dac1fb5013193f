"""``earl view``'s HTTP side: the page's files from static/ and a small JSON API over one RunDir.

    GET /                      static/index.html (app.js and style.css beside it, /static/NAME)
    GET /api/run?since=N       metrics records from index N, evaluations, the run's basics
    GET /api/layouts           the layouts view (rundir.layout_view)
    GET /api/samples?offset=&limit=&iteration=&env=&finish=&reward_min=&reward_max=&q=
                               one page of the samples' summaries (limit at most MAX_PAGE)
    GET /api/sample?key=K      one sample with its conversation and its episode's rows
    GET /report.png            the run's end-of-run report, when written

Every answer is read from the run directory at request time (rundir.py caches by file stamp), so
the page polling /api/run sees a live run grow. Only files named in STATIC are served: no path
from a request reaches the file system. A bad query value is a 400 naming the parameter. The
server binds 127.0.0.1 unless told otherwise (--host): it serves a run's texts to whoever
reaches it.
"""

from __future__ import annotations

import argparse
import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import parse_qs, urlparse

from earl_megatron.viewer.rundir import NotARun, RunDir

STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "charts.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
MAX_PAGE = 200


class BadQuery(ValueError):
    pass


def _arg(q: dict, name: str, kind=str, default=None):
    raw = q.get(name, [None])[0]
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise BadQuery(f"query parameter {name}={raw!r}: expected {kind.__name__}") from None


def answer(run: RunDir, path: str, query: str) -> tuple[int, str, bytes]:
    """(status, content type, body) of one GET: the routing, apart from the socket."""
    q = parse_qs(query)
    try:
        if path in ("/", "/index.html"):
            name = "index.html"
        elif path.startswith("/static/"):
            name = path[len("/static/"):]
        else:
            name = None
        if name is not None:
            if name not in STATIC:
                return HTTPStatus.NOT_FOUND, "text/plain", b"not found"
            return HTTPStatus.OK, STATIC[name], (STATIC_DIR / name).read_bytes()
        if path == "/report.png":
            f = run.path / "report.png"
            if not f.is_file():
                return HTTPStatus.NOT_FOUND, "text/plain", b"no report.png (written at the end)"
            return HTTPStatus.OK, "image/png", f.read_bytes()
        if path == "/api/run":
            body = run.run(since=max(_arg(q, "since", int, 0), 0))
        elif path == "/api/layouts":
            body = run.layouts()
        elif path == "/api/samples":
            limit = _arg(q, "limit", int, 50)
            if not 0 <= limit <= MAX_PAGE:
                raise BadQuery(f"query parameter limit={limit}: use 0..{MAX_PAGE}")
            body = run.page(offset=max(_arg(q, "offset", int, 0), 0), limit=limit,
                            iteration=_arg(q, "iteration", int), env=_arg(q, "env"),
                            finish=_arg(q, "finish"), reward_min=_arg(q, "reward_min", float),
                            reward_max=_arg(q, "reward_max", float), text=_arg(q, "q"))
        elif path == "/api/sample":
            key = _arg(q, "key")
            if key is None:
                raise BadQuery("query parameter key is missing (a key from /api/samples)")
            body = run.sample(key)
            if body is None:
                return HTTPStatus.NOT_FOUND, "application/json", \
                    json.dumps({"error": f"no sample {key}"}).encode()
        else:
            return HTTPStatus.NOT_FOUND, "text/plain", b"not found"
    except BadQuery as e:
        return HTTPStatus.BAD_REQUEST, "application/json", json.dumps({"error": str(e)}).encode()
    # NaN/inf in a record (a diverged loss) are written by json as bare words the page's
    # JSON.parse refuses: send them as null
    return HTTPStatus.OK, "application/json", json.dumps(_finite(body), default=str).encode()


def _finite(x):
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def make_server(run_dir, host: str = "127.0.0.1", port: int = 8600) -> ThreadingHTTPServer:
    """The server of ``run_dir`` bound to (host, port) (port 0: any free one); NotARun when
    run_dir is not a run. ``serve_forever`` runs it."""
    run = RunDir(run_dir)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            status, ctype, body = answer(run, url.path, url.query)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):   # one line per request is noise on a console
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.run = run
    return server


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="earl view", description="A web page of a run directory: "
                                "metrics, layouts per stage, the written episodes.")
    p.add_argument("run_dir", help="the run's run.output_dir (holds metrics.jsonl)")
    p.add_argument("--port", type=int, default=8600, help="port (0: any free one; default 8600)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 serves the network)")
    args = p.parse_args(argv)
    try:
        server = make_server(args.run_dir, args.host, args.port)
    except NotARun as e:
        print(f"earl view: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"earl view: cannot listen on {args.host}:{args.port} ({e.strerror}); choose "
              f"another with --port", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"earl view: {server.run.path} on http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
