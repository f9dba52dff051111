"""Chat out of the box, through the clients people use: the `openai` SDK, LangChain's ChatOpenAI and LiteLLM,
unchanged, against a real uvicorn server serving the bundled LMs with their play-dialogue chat template and
chat stop string (recipes.play_chat). Nothing may leave this machine while they run."""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from moe_serve.config import EngineConfig
from moe_serve.registry import resolve_model
from moe_serve.server.settings import ServerSettings
from recipes import play_chat
from recipes.build_demos import LANGUAGE_MODELS
from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "Elsinore. A platform before the castle."},
    {"role": "user", "content": "What news from the court, good friend?"},
]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    running = start_server(ServerSettings(models=LANGUAGE_MODELS, engine=EngineConfig(max_num_seqs=8)))
    yield running.url + "/v1"
    running.stop()


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch) -> Iterator[None]:
    """Every connection and name lookup must stay on this machine: a client library that phones home (a
    price list, telemetry, tracing, a tokenizer download) fails the test instead of leaking."""
    attempts: list[object] = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def local(host: object) -> bool:
        try:
            return ipaddress.ip_address(str(host).strip("[]")).is_loopback
        except ValueError:
            return host == "localhost"

    def guarded_connect(self, address):  # noqa: ANN001, ANN202
        if self.family in (socket.AF_INET, socket.AF_INET6) and not local(address[0]):
            attempts.append(address)
            raise OSError(f"test: no connections beyond this machine ({address})")
        return connect(self, address)

    def guarded_getaddrinfo(host, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if host is not None and not local(host.decode() if isinstance(host, bytes) else host):
            attempts.append(host)
            raise socket.gaierror(socket.EAI_NONAME, f"test: no lookups beyond this machine ({host})")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    yield
    assert not attempts, f"a client reached beyond 127.0.0.1: {attempts}"


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", LANGUAGE_MODELS)
def test_openai_chat_on_every_bundled_lm_with_logprobs(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=24, seed=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    assert choice.message.content and choice.finish_reason in {"stop", "length"}
    assert "\n\n" not in choice.message.content  # the chat stop string ends a speech
    tokens = choice.logprobs.content
    assert len(tokens) == response.usage.completion_tokens
    # Logprobs cover every generated token, the stop string's too; the text stops before it.
    generated = b"".join(bytes(t.bytes) for t in tokens).decode(errors="replace")
    assert generated == choice.message.content + ("\n\n" if choice.finish_reason == "stop" else "")
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    moe = json.loads((resolve_model(model) / "config.json").read_text())["model"]["moe"]
    assert response.usage.experts_per_token == (moe["experts_per_token"]["default"] if moe else None)


def test_openai_streaming_chat_equals_the_whole_reply(client: openai.OpenAI) -> None:
    kwargs = dict(model="shakespeare-hyperrouter", messages=MESSAGES, max_tokens=40, seed=3)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.experts_per_token == 8


def test_a_reply_ends_at_the_chat_stop_unless_the_request_sets_its_own(client: openai.OpenAI, base_url: str) -> None:
    info = httpx.get(base_url.removesuffix("/v1") + "/tokenizer_info", params={"model": "shakespeare-smoe"}).json()
    assert info["chat_stop"] == list(play_chat.STOP) and info["chat_template"] == play_chat.BOS + play_chat.TEMPLATE
    kwargs = dict(model="shakespeare-smoe", messages=MESSAGES, max_tokens=64, temperature=0.8)
    # A seed whose reply ends by itself (a seed reproduces its tokens, whatever `stop` says).
    for seed in range(32):
        default = client.chat.completions.create(seed=seed, **kwargs).choices[0]
        if default.finish_reason == "stop":
            break
    else:
        pytest.fail("no reply in 32 seeds reached the end of its speech within 64 bytes")
    assert default.message.content and "\n\n" not in default.message.content
    # The request's own stop replaces the default: `[]` turns it off, and the text runs on past the speech.
    off = client.chat.completions.create(seed=seed, stop=[], **kwargs).choices[0]
    assert off.message.content.startswith(default.message.content + "\n\n")
    # A stop string of the client's own (the speech's last character): the same tokens, cut at its first use.
    last = default.message.content[-1]
    own = client.chat.completions.create(seed=seed, stop=[last], **kwargs).choices[0]
    assert own.finish_reason == "stop" and own.message.content == default.message.content.split(last)[0]


def test_a_chat_reply_without_max_tokens_runs_to_the_end_of_the_context(client: openai.OpenAI, base_url: str) -> None:
    """As OpenAI's and vLLM's chat (not completions' 16 tokens): a prompt ~50 tokens short of the context, no stop."""
    context = httpx.get(base_url.removesuffix("/v1") + "/tokenizer_info", params={"model": "shakespeare-smoe"}).json()
    speech = ("Words, words, words. " * 1000)[: context["model_max_length"] - 64]
    reply = client.chat.completions.create(
        model="shakespeare-smoe", messages=[{"role": "user", "content": speech}], stop=[]
    )
    assert reply.usage.total_tokens == context["model_max_length"] and reply.usage.completion_tokens > 16
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "model,extra_body,k",
    [
        ("shakespeare-smoe", None, 8),
        ("shakespeare-smoe:k1", None, 1),
        ("shakespeare-smoe", {"experts_per_token": 1}, 1),
    ],
    ids=["default k", "k in the name", "extra_body"],
)
def test_langchain_chat_openai(base_url: str, model: str, extra_body: dict | None, k: int) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=model, base_url=base_url, api_key="unused", max_tokens=32, seed=1, max_retries=0, extra_body=extra_body
    )
    reply = chat.invoke([SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])])
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["token_usage"]["experts_per_token"] == k


def test_litellm_completion(base_url: str, monkeypatch) -> None:
    # LiteLLM fetches a price list when imported unless told to use the copy it ships.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    monkeypatch.setattr(litellm, "telemetry", False)
    response = litellm.completion(
        model="openai/shakespeare-smoe", api_base=base_url, api_key="unused", messages=MESSAGES, max_tokens=32, seed=2
    )
    assert response.choices[0].message.content and response.choices[0].finish_reason in {"stop", "length"}
    assert response.usage.experts_per_token == 8
