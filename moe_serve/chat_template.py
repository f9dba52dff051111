"""The environment chat templates render in: Hugging Face's (so a template written for transformers renders
the same text here), sandboxed, with a cap on what one render may build. Used to check an artifact's
template when it loads and to render messages for a request."""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise TemplateError(message)  # e.g. Mixtral's "roles must alternate": the request's problem, a 400


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:  # noqa: ANN001
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment (transformers' `_compile_jinja_template`: trim and lstrip
    blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), so templates
    written for transformers render the same here; and a sandbox in which `*` and `**` cannot build a
    string or list longer than the render cap at once."""

    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, cap: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.cap = cap
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context, operator: str, left, right):  # noqa: ANN001  # jinja's signature
        if operator == "*" and isinstance(left, str | list | tuple) and isinstance(right, int):
            if len(left) * right > self.cap:
                raise TemplateError(f"the template repeats a value {right} times, past the render cap")
        if operator == "*" and isinstance(right, str | list | tuple) and isinstance(left, int):
            return self.call_binop(context, operator, right, left)
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise TemplateError("the template raises a number to a power above 1024")
        return super().call_binop(context, operator, left, right)
