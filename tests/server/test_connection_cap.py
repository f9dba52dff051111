"""Open connections are bounded within the process's open-file limit: `moe-serve serve` in its own process
under `ulimit -n 600` with the default --max-connections (1,024), flooded with 700 idle connections, lowers
its limit to fit (and says so), answers the connections past it with the 503 envelope as they are accepted,
logs them once a second (not once a connection, not a traceback), and serves again once they close."""

from __future__ import annotations

import json
import re
import resource
import socket
import subprocess
import sys
import time

import httpx
import pytest

from moe_serve.server.http_server import PROBE_CONNECTIONS
from tests.conftest import free_port
from tests.server.test_errors_and_limits import wait_ready

FILE_LIMIT = 600
FLOOD = 700  # past the file limit: without the cap the accepts fail for want of descriptors


def read_answer(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


@pytest.mark.slow
def test_a_flood_of_idle_connections_gets_503s_within_the_file_limit(artifacts, tmp_path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))

    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moe_serve", "serve", str(artifacts["lm"]), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_files,
        )
    url = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    try:
        wait_ready(url)
        lowered = re.search(r"--max-connections 1024 lowered to (\d+)", log_path.read_text())
        assert lowered is not None, log_path.read_text()
        fitted = int(lowered.group(1))
        assert 100 < fitted < FILE_LIMIT - PROBE_CONNECTIONS

        started = time.monotonic()
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(FLOOD)]
        refused = [s for s in flood[fitted + PROBE_CONNECTIONS :] if s]
        answers = [read_answer(s) for s in refused[:20]]
        for answer in answers:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head, answer
            error = json.loads(body)["error"]
            assert error["type"] == "service_unavailable" and f"maximum of {fitted} connections" in error["message"]
        with httpx.Client(timeout=10) as http:  # a client still gets an answer at once, never a timeout
            assert http.get(url + "/health").status_code in (200, 503)
        assert process.poll() is None
        for sock in flood:
            sock.close()
        flood.clear()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the server did not serve again once the connections closed")
        elapsed = time.monotonic() - started
    finally:
        for sock in flood:
            sock.close()
        process.terminate()
        process.wait(timeout=30)
    text = log_path.read_text()
    refusals = [line for line in text.splitlines() if "connections refused (503)" in line]
    assert 1 <= len(refusals) <= elapsed / 1.0 + 1, refusals
    accept_failures = [line for line in text.splitlines() if "accepts failed for want of a file descriptor" in line]
    assert len(accept_failures) <= elapsed / 1.0 + 1, accept_failures
    assert "Traceback" not in text and "out of system resource" not in text, text[-3000:]
