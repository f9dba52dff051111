"""A real uvicorn server on a free loopback port, serving a tiny LM and a tiny classifier."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import uvicorn

from moe_serve.config import EngineConfig, RequestLimits
from moe_serve.server.app import create_app
from moe_serve.server.http_server import build_server
from moe_serve.server.settings import ServerSettings
from moe_serve.testing import create_random_artifact
from tests.conftest import classifier_config, free_port, lm_config

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class RunningServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(settings: ServerSettings) -> RunningServer:
    port = free_port()
    settings = replace(settings, port=port, log_level="warning")
    server = build_server(app := create_app(settings), settings)  # what `moe-serve serve` runs
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    return RunningServer(f"http://127.0.0.1:{port}", app, server, thread)


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    return {
        "lm": create_random_artifact(
            root / "tiny-lm", lm_config(chat_template=CHAT_TEMPLATE, max_position_embeddings=128), seed=21
        ),
        "clf": create_random_artifact(root / "tiny-clf", classifier_config(), seed=22),
    }


def start_test_server(artifacts: dict[str, Path], tmp_path_factory, **engine) -> RunningServer:
    """The tiny LM and classifier served as the end-to-end tests expect (engine: EngineConfig overrides)."""
    return start_server(
        ServerSettings(
            models=(str(artifacts["lm"]), str(artifacts["clf"])),
            limits=RequestLimits(max_tokens_cap=64),
            engine=EngineConfig(max_num_seqs=16, **engine),
            data_dir=str(tmp_path_factory.mktemp("batch-data")),  # the Batch API's state, never the user's
        )
    )


@pytest.fixture(scope="session")
def server(artifacts, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_test_server(artifacts, tmp_path_factory)
    yield running
    running.stop()


@pytest.fixture
def client(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
