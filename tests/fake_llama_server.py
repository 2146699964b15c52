"""A stand-in for llama.cpp's llama-server: /health, and /completion answering n_predict.

Enough of the protocol for bench offline's peer driver to be tested without llama.cpp.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply({"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert isinstance(body["prompt"], list) and body["ignore_eos"] is True
        self._reply({"tokens_predicted": body["n_predict"], "content": "x"})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("-np")
    p.add_argument("-cb", action="store_true")
    p.add_argument("-t")
    p.add_argument("-c")
    args = p.parse_args()
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
