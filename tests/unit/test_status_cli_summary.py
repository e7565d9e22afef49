"""``slotsync status``'s summary line on stderr tells whether a failed slot's engine is paused
(a fresh-user trial found it saying "engine paused" for a round refused before the pause)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from slotsync.cli import status as status_cli


def _serve(doc: dict) -> tuple[HTTPServer, str]:
    body = json.dumps(doc).encode()

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize(("paused", "says"), [
    (False, "engine still serving"), (True, "engine paused until a complete update succeeds")])
def test_summary_says_whether_the_failed_slots_engine_is_paused(capsys, paused, says):
    from test_coordinator import Harness

    h = Harness()
    h.register_all()
    doc = h.coord.status()
    doc.update(state="failed", engine_paused=paused)
    srv, url = _serve({"version": "x", "endpoint": "e", "slots": [doc], "released_engines": []})
    try:
        rc = status_cli.main_from_args(status_cli.build_parser().parse_args(["--url", url]))
    finally:
        srv.shutdown()
    err = capsys.readouterr().err
    assert rc == 1 and says in err, err
