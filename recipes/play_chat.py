"""The chat template of the bundled Shakespeare LMs (the one place it is written; build_demos installs it).

The models only ever saw play text in the layout of moe_serve.evaluation.datasets.shakespeare: a speaker's
name in capitals with a full stop on its own line, the speech below it, a blank line before the next
speaker or stage direction. So a conversation is rendered as a scene in that layout: system (and developer)
messages as stage directions, the user as HAMLET, the assistant as HORATIO (a message's `name` renames its
speaker), and the generation prompt opens the assistant's speech. A speech ends at the blank line before the
next one, so that is the chat stop string. LMs trained with BOS and EOS (<|endoftext|>: every training
window starts with it, every play ends with it) get BOS first in the template, as a text prompt gets it
from the engine, and end generation at EOS too; but EOS ends a play, not a speech, so the blank line stays
the stop of a reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe_serve.artifact import CONFIG_FILE
from moe_serve.model_config import ModelConfig

# Hugging Face's template environment (trim/lstrip blocks): every tag strips its own whitespace, and all
# text the template emits is in expressions, so the layout is exactly the strings below.
TEMPLATE = r"""{%- set speakers = {'user': 'HAMLET', 'assistant': 'HORATIO'} -%}
{%- set scene = namespace(assistant=speakers['assistant']) -%}
{%- for message in messages -%}
    {%- if message['role'] in ['system', 'developer'] -%}
        {{- message['content'] | trim ~ '\n\n' -}}
    {%- elif message['role'] in speakers -%}
        {%- set speaker = ((message['name'] or '') | trim or speakers[message['role']]) | upper -%}
        {%- if message['role'] == 'assistant' -%}
            {%- set scene.assistant = speaker -%}
        {%- endif -%}
        {{- speaker ~ '.\n' ~ message['content'] | trim ~ '\n\n' -}}
    {%- else -%}
        {{- raise_exception('this play has no part for role ' ~ message['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- scene.assistant ~ '.\n' -}}
{%- endif -%}
"""

# A speech ends at a blank line (the next speaker or stage direction follows it).
STOP = ("\n\n",)

# First, for a model trained with BOS: the engine adds BOS to a text prompt (add_bos_token), but a chat
# prompt is the rendered template alone, as in Hugging Face's templates, which write bos_token themselves.
BOS = "{{- bos_token -}}\n"


def template_for(model: Mapping[str, Any]) -> str:
    """The template of a model (its config.json `model`): TEMPLATE, after BOS if it wants one."""
    return BOS + TEMPLATE if model.get("add_bos_token") else TEMPLATE


def install(artifact: Path) -> None:
    """Write the template and STOP into an artifact's config.json; nothing else changes (config.json is
    not among the checksummed files, so the weights and tokenizer keep their recorded sha256)."""
    path = Path(artifact) / CONFIG_FILE
    manifest = json.loads(path.read_text())
    manifest["model"].update(chat_template=template_for(manifest["model"]), chat_stop=list(STOP))
    ModelConfig.from_dict(manifest["model"])  # refuse to write a config the loader would refuse
    path.write_text(json.dumps(manifest, indent=2) + "\n")  # save_artifact's layout
