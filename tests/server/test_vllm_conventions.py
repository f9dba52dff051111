"""vLLM's small conventions, through a real uvicorn and the openai client: --served-model-name (aliases, the
first reported everywhere), GET /version, GET and POST /ping, both open without the API key."""

from __future__ import annotations

import httpx
import openai
import pytest

from moe_serve import __version__
from moe_serve.cli.parser import build_parser
from moe_serve.config import EngineConfig
from moe_serve.errors import ValidationError
from moe_serve.server.settings import ServerSettings
from tests.server.conftest import start_server

KEY = "s3cret"


@pytest.fixture(scope="module")
def aliased(artifacts):
    settings = ServerSettings(
        models=(str(artifacts["lm"]),),
        served_model_name=("prod-lm", "tiny-lm-alias"),
        api_key=KEY,
        engine=EngineConfig(max_num_seqs=4),
    )
    running = start_server(settings)
    yield running
    running.stop()


def test_every_served_name_answers_and_the_first_is_reported(aliased) -> None:
    client = openai.OpenAI(base_url=aliased.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data][0] == "prod-lm"
    assert client.models.retrieve("tiny-lm-alias").id == "prod-lm"
    for asked, reported in [("prod-lm", "prod-lm"), ("tiny-lm-alias", "prod-lm"), ("tiny-lm-alias:k1", "prod-lm:k1")]:
        completion = client.completions.create(model=asked, prompt="Hi", max_tokens=2)
        assert completion.model == reported
        stream = client.chat.completions.create(
            model=asked, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
        assert {chunk.model for chunk in stream} == {reported}
    with pytest.raises(openai.NotFoundError, match="tiny-lm"):  # the artifact's own name is not served now
        client.completions.create(model="tiny-lm", prompt="Hi", max_tokens=1)
    metrics = httpx.get(aliased.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'model="prod-lm"' in metrics and 'model="tiny-lm-alias"' not in metrics


def test_version_and_ping_answer_without_the_api_key(aliased) -> None:
    with httpx.Client(base_url=aliased.url) as http:
        assert http.get("/version").json() == {"version": __version__}
        for method in ("GET", "POST"):
            ping = http.request(method, "/ping")
            assert ping.status_code == 200 and ping.content == b""
        assert http.get("/v1/models").status_code == 401  # the API itself still needs the key


def test_served_model_name_is_parsed_as_vllm_spells_it_and_names_one_model() -> None:
    args = build_parser().parse_args(["serve", "tiny", "--served-model-name", "a", "b"])
    assert args.served_model_name == ["a", "b"]
    assert ServerSettings(models=("tiny",), served_model_name=["a", "b"]).served_model_name == ("a", "b")
    with pytest.raises(ValidationError, match="names one model, but 2 models are served"):
        ServerSettings(models=("x", "y"), served_model_name=("a",))
    with pytest.raises(ValidationError, match="no MODEL is given"):
        ServerSettings(served_model_name=("a",))
    with pytest.raises(ValidationError, match="repeat"):
        ServerSettings(models=("x",), served_model_name=("a", "a"))
    with pytest.raises(ValidationError, match="is not a name"):
        ServerSettings(models=("x",), served_model_name=(" a",))
