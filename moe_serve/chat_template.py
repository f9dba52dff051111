"""The environment chat templates render in: Hugging Face's (so a template written for transformers renders
the same text here), sandboxed, with bounds on what one render may do: not only on the text it emits, but on
the values it builds without emitting them (memory) and on the steps and time it takes (work). Used to
check an artifact's template when it loads and to render messages for a request (one environment per
render: its budget starts when it is made)."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# What one render may take, whatever the template: loop iterations, calls (functions, methods, macros,
# filters) and operators counted as steps; and wall-clock seconds, checked at every step. A chat template
# over the largest conversation a request may send (protocol.MAX_MESSAGES) takes some tens of thousands.
MAX_RENDER_STEPS = 1_000_000
MAX_RENDER_SECONDS = 5.0
MAX_INT_BITS = 1 << 16  # integers a template computes (repeated squaring would otherwise fill memory)
_GUARD = "__moe_serve_step"  # the filter wrapped around every loop's iterable
_SIZED = "__moe_serve_sized"  # ... and around each operand and result of `~`
_DIGITS = re.compile(r"\d+")
_SIZED_TYPES = (str, bytes, list, tuple, dict, set, frozenset)
_JOINS = frozenset(["join", "sum", "string", "tojson", "pprint", "urlencode", "xmlattr", "list", "format"])


class RenderLimitError(TemplateError):
    """A render went past one of its bounds (the request's problem, a 400 naming `messages`)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)  # e.g. Mixtral's "roles must alternate": the request's problem, a 400


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Guard(NodeTransformer):
    """Rewrites a parsed template: every `for` iterates through the step guard, and `~` checks the size of
    what it joins (Jinja compiles `~` to a plain join that no sandbox hook sees)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)  # type: ignore[assignment]  # a For stays a For
        node.iter = nodes.Filter(node.iter, _GUARD, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)  # type: ignore[assignment]
        node.nodes = [nodes.Filter(n, _SIZED, [], [], None, None, lineno=node.lineno) for n in node.nodes]
        return nodes.Filter(node, _SIZED, [], [], None, None, lineno=node.lineno)


class TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Hugging Face's chat-template environment (transformers' `_compile_jinja_template`: trim and lstrip
    blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), so templates
    written for transformers render the same here; and a sandbox in which one render is bounded:

    - no value it builds (a string, a list, its text once joined or emitted) is longer than the cap, checked
      before the operations that multiply their input (`*`, `~`, joins, `%` and `format` widths, `replace`,
      `indent`, padding to a width) and after every operator, call and filter;
    - no integer is longer than MAX_INT_BITS bits;
    - at most `max_steps` steps (each loop iteration, call, filter and operator) and `max_seconds` seconds,
      so nested loops that emit nothing still end; recursion too deep is refused as well.
    """

    intercepted_binops = frozenset(["*", "**", "+", "%", "//", "/", "-"])

    def __init__(self, cap: int, max_steps: int = MAX_RENDER_STEPS, max_seconds: float = MAX_RENDER_SECONDS) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=self._emitted)
        self.cap = cap
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.steps = 0
        self.deadline = time.monotonic() + max_seconds
        self.filters["tojson"] = _tojson
        self.filters = {name: self._guarded_filter(name, f) for name, f in self.filters.items()}
        self.filters[_GUARD] = self._iterate
        self.filters[_SIZED] = self._sized
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    # ---- the budget ------------------------------------------------------------------------------

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise RenderLimitError(f"the template takes more than {self.max_steps} steps to render")
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise RenderLimitError(f"the template takes more than {self.max_seconds:g} seconds to render")

    def render_parts(self, source: str, **variables: Any) -> Iterator[str]:
        """The template's output as it renders; every failure of the template's own making (an error it
        raises, a bound it crosses, arithmetic it gets wrong, recursion too deep) is a TemplateError."""
        try:
            yield from self.from_string(source).generate(**variables)
        except TemplateError:
            raise
        except RecursionError:
            raise RenderLimitError("the template recurses too deeply") from None
        except MemoryError:
            raise RenderLimitError("the template builds values too large to hold") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
            raise TemplateError(f"{type(exc).__name__}: {exc}") from None

    # ---- sizes -----------------------------------------------------------------------------------

    def _too_large(self, what: str) -> RenderLimitError:
        return RenderLimitError(f"the template builds {what} longer than the render cap of {self.cap} characters")

    def check_result(self, value: Any) -> Any:
        """A value just built: no longer than the cap (an integer: no longer than MAX_INT_BITS)."""
        if isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value.bit_length() > MAX_INT_BITS:
                raise RenderLimitError(f"the template computes an integer of more than {MAX_INT_BITS} bits")
        elif isinstance(value, _SIZED_TYPES) and len(value) > self.cap:
            raise self._too_large("a value")
        return value

    def check_text_size(self, value: Any) -> None:
        """`value`, as text (a join, str(), JSON), would be no longer than the cap. Walks at most cap + 1
        items: every item counts at least one character, every string its length."""
        if isinstance(value, str):
            if len(value) > self.cap:
                raise self._too_large("text")
            return
        size, stack = 0, [value]
        while stack:
            item = stack.pop()
            if isinstance(item, str | bytes):
                size += len(item) + 1
            elif isinstance(item, dict):
                size += 1
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list | tuple | set | frozenset):
                size += 1
                stack.extend(item)
            else:
                size += 1
            if size > self.cap or len(stack) > self.cap:
                raise self._too_large("text")

    def check_format(self, pattern: Any) -> None:
        """No field width or precision in a format string (`%9999999s`, `{:>9999999}`) past the cap."""
        if isinstance(pattern, str):
            width = len(str(self.cap))
            for digits in _DIGITS.findall(pattern):
                if len(digits) >= width and int(digits) > self.cap:
                    raise self._too_large("a formatted field")

    def _check_ints(self, args: Iterable[Any]) -> None:
        """A width or count argument (`center(10**9)`, `zfill`, `indent`) no larger than the cap."""
        for arg in args:
            if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > self.cap:
                raise self._too_large(f"a value (a width or count of {arg})")

    def _check_expansion(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Operations whose result can be much longer than their input: estimated before they run."""
        if name in _JOINS:
            self.check_text_size(value)
            self.check_text_size(list(args))
        if name == "format":
            self.check_format(value)
        if not isinstance(value, str):
            return
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            old, new = args[0], args[1]
            count = len(value) + 1 if not old else value.count(old)
            if len(value) + count * (len(new) - len(old)) > self.cap:
                raise self._too_large("a replacement")
        elif name in ("indent", "wordwrap", "expandtabs"):
            pieces = [a for a in (*args, *kwargs.values()) if isinstance(a, str | int) and not isinstance(a, bool)]
            unit = max((len(a) if isinstance(a, str) else a for a in pieces), default=8)
            lines = value.count("\t" if name == "expandtabs" else "\n") + 1
            if name == "wordwrap":
                lines = len(value) + 1  # a break after every character, at worst
            if len(value) + lines * unit > self.cap:
                raise self._too_large(f"text (by {name})")

    # ---- the sandbox's hooks ---------------------------------------------------------------------

    def _iterate(self, iterable: Any) -> Iterator[Any]:
        for item in iterable:
            self.step()
            yield item

    def _sized(self, value: Any) -> Any:
        self.step()
        self.check_text_size(value)
        return value

    def _emitted(self, value: Any) -> Any:
        self.check_text_size(value)  # what `{{ ... }}` writes, before it becomes text
        return value

    def concat(self, parts: Iterable[str]) -> str:  # jinja's class attribute is "".join
        """What compiled templates join their buffers with (a macro's or a `set` block's output, text that
        may never be emitted): no longer than the cap."""
        collected, size = [], 0
        for part in parts:
            size += len(part)
            if size > self.cap:
                raise self._too_large("text (a macro or block's output)")
            collected.append(part)
        return "".join(collected)

    def _guarded_filter(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        offset = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0  # context, environment, ...

        @functools.wraps(function)  # keeps `jinja_pass_arg`
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.step()
            if name in _JOINS and len(args) > offset and not isinstance(args[offset], _SIZED_TYPES):
                args = (*args[:offset], list(self._iterate(args[offset])), *args[offset + 1 :])  # sized, to check
            value, rest = (args[offset], args[offset + 1 :]) if len(args) > offset else (None, ())
            self._check_ints((*rest, *kwargs.values()))
            self._check_expansion(name, value, rest, kwargs)
            return self.check_result(function(*args, **kwargs))

        return guarded

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805  # jinja's
        __self.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level iterates through the guard
            args = (__self._iterate(args[0]), *args[1:])
        __self._check_ints((*args, *kwargs.values()))
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            __self._check_expansion(name, owner, args, kwargs)
            if name == "join" and args:
                if not isinstance(args[0], _SIZED_TYPES):
                    args = (list(__self._iterate(args[0])), *args[1:])
                __self.check_text_size(args[0])
        return __self.check_result(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        self.check_format(getattr(value, "__self__", None))  # "{:>9999999}".format(x)
        return super().wrap_str_format(value)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:  # jinja's signature
        self.step()
        if operator == "*" and isinstance(right, str | list | tuple) and isinstance(left, int):
            left, right = right, left
        if operator == "*" and isinstance(left, str | list | tuple) and isinstance(right, int):
            if len(left) * right > self.cap:
                raise RenderLimitError(f"the template repeats a value {right} times, past the render cap")
        if operator == "*" and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise RenderLimitError(f"the template computes an integer of more than {MAX_INT_BITS} bits")
        if operator == "**" and isinstance(right, int) and abs(right) > 1024:
            raise RenderLimitError("the template raises a number to a power above 1024")
        if operator == "**" and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() * abs(right) > MAX_INT_BITS:
                raise RenderLimitError(f"the template computes an integer of more than {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):
            self.check_format(left)
            self.check_text_size(right)
        return self.check_result(super().call_binop(context, operator, left, right))

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guard().visit(super()._parse(source, name, filename))
