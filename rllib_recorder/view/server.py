"""The viewer's HTTP server: the standard library's ThreadingHTTPServer, by default on 127.0.0.1, serving the
page's files from the package, the JSON API and the live stream, and nothing else."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from rllib_recorder.errors import RecorderError
from rllib_recorder.view import api, live
from rllib_recorder.view.catalog import Catalog, NotFound
from rllib_recorder.view.pictures import Simulations

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".txt": "text/plain; charset=utf-8"}
# The page runs only its own files: no inline script, nothing from another origin (a recording's strings are
# shown as text anyway; this is the second wall).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: "
                               "blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cross-Origin-Resource-Policy": "same-origin",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_PARAM_CHARS = 1 << 18


class ViewServer(ThreadingHTTPServer):
    """The viewer's server over a ``Catalog`` of runs; ``serve_forever`` until ``shutdown``."""

    daemon_threads = True  # a live stream's thread must not keep the process after Ctrl-C

    def __init__(self, catalog: Catalog, host: str = "127.0.0.1", port: int = 0, poll_s: float = live.POLL_S):
        self.catalog = catalog
        self.simulations = Simulations()
        self.verdicts: dict[str, Any] = {}
        self.poll_s = poll_s
        self.host = host
        self.assets = page_files()
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)
        self.port = int(self.server_address[1])
        shown = host if host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        self.url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{self.port}/"
        # Behind 127.0.0.1 a page from elsewhere could still reach the server through a name that resolves
        # to 127.0.0.1 (DNS rebinding): only requests naming the server by its loopback address are answered.
        self.hosts = ({f"{name}:{self.port}" for name in ("127.0.0.1", "localhost", "[::1]")}
                      if host in LOOPBACK else None)

    def warm(self) -> threading.Thread:
        """Reads what the runs page shows, then verify's verdicts, in a thread: the first page finds them ready
        (a request that comes first waits for its run's lock, and the work is done once)."""
        def work() -> None:
            try:
                for row in api.runs_json(self.catalog)["runs"]:
                    api.verdict_json(self.catalog, row["id"], self.verdicts)
            except Exception:  # the page asks again and gets the error as its answer
                pass

        thread = threading.Thread(target=work, name="view-warm", daemon=True)
        thread.start()
        return thread

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A page that went away mid-request is nothing to report; anything else is one line, not a traceback."""
        error = sys.exc_info()[1]
        if not isinstance(error, (ConnectionError, TimeoutError)):
            print(f"view: a request failed ({type(error).__name__}: {error})", file=sys.stderr)


def page_files() -> dict[str, tuple[bytes, str, str]]:
    """The page's files (name -> content, type, content hash), read once; ``index.html`` names the others with
    their hash (``/static/app.js?v=...``), so that a browser keeps them until they change."""
    files = {}
    for name in sorted(os.listdir(STATIC_DIR)):
        kind = CONTENT_TYPES.get(os.path.splitext(name)[1])
        if kind is not None:
            with open(os.path.join(STATIC_DIR, name), "rb") as f:
                body = f.read()
            files[name] = (body, kind, hashlib.sha256(body).hexdigest()[:16])
    page = files["index.html"][0]
    for name, (_, _, version) in files.items():
        page = page.replace(f'"/static/{name}"'.encode(), f'"/static/{name}?v={version}"'.encode())
    files["index.html"] = (page, files["index.html"][1], "")
    return files


class Handler(BaseHTTPRequestHandler):
    """One request: a page file, a JSON answer, frames, a picture, or the live stream; 404 for anything else."""

    server: ViewServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the terminal shows the URL, not each request
        pass

    def do_GET(self) -> None:
        try:
            self._route()
        except NotFound as e:
            self._json({"error": str(e)}, 404)
        except ValueError as e:
            self._json({"error": str(e)}, 400)
        except (RecorderError, OSError, KeyError, IndexError, RuntimeError) as e:  # a damaged file, a bad episode
            self._json({"error": " ".join(str(e).split()) or type(e).__name__})
        except Exception as e:  # one request's failure is answered, never the server's end
            self._json({"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}, 500)

    def _route(self) -> None:
        if self.server.hosts is not None and self.headers.get("Host", "") not in self.server.hosts:
            self._send(403, b"this viewer answers only at its own address\n", "text/plain; charset=utf-8")
            return
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        if "\\" in path or "\0" in path or any(s in ("..", ".") for s in path.split("/")) or "//" in path:
            raise NotFound("no such page")
        query = {k: v[0] for k, v in parse_qs(parts.query, max_num_fields=32).items()}
        if any(len(v) > MAX_PARAM_CHARS for v in query.values()):
            raise ValueError("a parameter is too long")
        if path == "/":
            self._static("index.html")
        elif path.startswith("/static/"):
            self._static(path[len("/static/"):], query.get("v"))
        elif path in ROUTES:
            ROUTES[path](self, query)
        else:
            raise NotFound("no such page")

    def _static(self, name: str, version: str | None = None) -> None:
        found = self.server.assets.get(name)
        if found is None:
            raise NotFound("no such file")
        body, kind, current = found
        # the page names each file with its content's hash: a browser keeps it until the file changes
        cache = "public, max-age=31536000, immutable" if version == current else "no-cache"
        self._send(200, body, kind, {"Cache-Control": cache})

    def _send(self, status: int, body: bytes, kind: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**SECURITY_HEADERS, "Cache-Control": "no-store", **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value: Any, status: int = 200) -> None:
        body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _events(self, catalog: Catalog, run_id: str, known: dict[str, int]) -> None:
        catalog.path_of(run_id)  # 404 before the stream starts
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        for name, value in {**SECURITY_HEADERS, "Cache-Control": "no-store"}.items():
            self.send_header(name, value)
        self.end_headers()
        self.close_connection = True

        def send(event: str, data: Any) -> None:
            text = f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n" \
                if event else ": keep-alive\n\n"
            self.wfile.write(text.encode())
            self.wfile.flush()

        try:
            live.stream(catalog, run_id, known, send, poll_s=self.server.poll_s)
        except (BrokenPipeError, ConnectionResetError):  # the page went away
            pass
        except Exception as e:  # after the headers: said in the stream, which then ends
            try:
                send("failed", {"error": " ".join(str(e).split()) or type(e).__name__})
            except OSError:
                pass


def _int(query: dict[str, str], name: str, default: int) -> int:
    try:
        return int(query.get(name, default))
    except ValueError:
        raise ValueError(f"{name} must be a whole number") from None


def _need(query: dict[str, str], *names: str) -> list[str]:
    missing = [n for n in names if not query.get(n)]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    return [query[n] for n in names]


def _runs(h: Handler, q: dict[str, str]) -> None:
    h._json(api.runs_json(h.server.catalog))


def _run(h: Handler, q: dict[str, str]) -> None:
    h._json(api.run_json(h.server.catalog, *_need(q, "run")))


def _verdict(h: Handler, q: dict[str, str]) -> None:
    h._json(api.verdict_json(h.server.catalog, *_need(q, "run"), h.server.verdicts))


def _episodes(h: Handler, q: dict[str, str]) -> None:
    h._json(api.episodes_json(h.server.catalog, *_need(q, "run"), sort=q.get("sort", "end"),
                              descending=q.get("order", "desc") != "asc", offset=_int(q, "offset", 0),
                              limit=_int(q, "limit", 50), finished=q.get("finished") == "1",
                              evaluation=q.get("evaluation", "all")))


def _episode(h: Handler, q: dict[str, str]) -> None:
    h._json(api.episode_json(h.server.catalog, *_need(q, "run", "file", "episode"), t=max(0, _int(q, "t", 0))))


def _frames(h: Handler, q: dict[str, str]) -> None:
    run_id, file, eps_id, agent = _need(q, "run", "file", "episode", "agent")
    body, headers = api.frames_bytes(h.server.catalog, run_id, file, eps_id, agent, max(0, _int(q, "start", 0)),
                                     max(1, _int(q, "count", 64)))
    h._send(200, body, "application/octet-stream", headers)


def _picture(h: Handler, q: dict[str, str]) -> None:
    run_id, file, eps_id = _need(q, "run", "file", "episode")
    h._send(200, api.picture_png(h.server.catalog, h.server.simulations, run_id, file, eps_id, _int(q, "t", 0)),
            "image/png", {"Cache-Control": "private, max-age=3600"})


def _stream(h: Handler, q: dict[str, str]) -> None:
    (run_id,) = _need(q, "run")
    try:
        known = json.loads(q.get("cursor") or "{}")
    except ValueError:
        raise ValueError("cursor is not JSON") from None
    if not isinstance(known, dict):
        raise ValueError("cursor is an object of counts")
    h._events(h.server.catalog, run_id, {str(k): int(v) for k, v in known.items() if isinstance(v, int)})


ROUTES: dict[str, Callable[[Handler, dict[str, str]], None]] = {
    "/api/runs": _runs, "/api/run": _run, "/api/verdict": _verdict, "/api/episodes": _episodes,
    "/api/episode": _episode, "/api/frames": _frames, "/api/picture": _picture, "/api/events": _stream,
}
