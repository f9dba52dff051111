"""The batch file formats, shared by `moe-serve batch` and the HTTP Batch API: input lines parsed into
runnable items or line problems, output lines in the strict OpenAI batch-output shape, and what a previous
(possibly killed) `moe-serve batch` run already wrote.

Input lines: {"custom_id", "method": "POST", "url", "body"} for /v1/completions, /v1/chat/completions,
/v1/classify and /v1/score (`moe-serve batch` also reads a top-level "label": a classify line's true class,
for quality against k). Output lines are exactly {"id", "custom_id", "response": {"status_code",
"request_id", "body"} | null, "error": {"code", "message"} | null}: moe-serve's extensions (the k used,
`approximate`) are in the body's `usage`, as over HTTP. In a k sweep every line is answered once per k, and
the answer's custom_id is `<custom_id>:k<k>` (the `name:k<k>` syntax of model names), so that output
custom_ids stay unique.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_serve.errors import ValidationError

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/classify", "/v1/score")
MAX_CUSTOM_ID = 512
SWEEP_SUFFIX = ":k"  # "<custom_id>:k2": the line's answer at k = 2
LINE_FIELDS = ("custom_id", "method", "url", "body")
OUTPUT_FIELDS = {"id", "custom_id", "response", "error"}


@dataclass(slots=True)
class BatchItem:
    line: int  # 1-based line number in the input
    custom_id: str
    url: str
    body: dict[str, Any]
    model: str | None  # the body's, else the run's default
    k: int | None  # the sweep's k (None: the body's own experts_per_token)
    label: str | None = None
    scope: str = ""  # salts the line ids: an HTTP batch's id (ids unique across batches); "" for a file

    @property
    def output_custom_id(self) -> str:
        return sweep_custom_id(self.custom_id, self.k)

    @property
    def line_id(self) -> str:
        return line_id(f"{self.scope}/{self.custom_id}" if self.scope else self.custom_id, self.k)


@dataclass(frozen=True, slots=True)
class LineProblem:
    """An input line that cannot run: an error line for `moe-serve batch`, a validation error for the API."""

    line: int
    code: str
    message: str
    param: str | None = None

    def to_error(self) -> dict[str, Any]:
        """The Batch API's `errors.data` entry."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(slots=True)
class ParsedInput:
    items: list[BatchItem] = field(default_factory=list)  # one per runnable line and k
    problems: list[LineProblem] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)  # custom_ids used again (those lines not run)

    @property
    def num_lines(self) -> int:
        return len({i.line for i in self.items}) + len(self.problems)


@dataclass(slots=True)
class LineResult:
    """One item's answer: its output line, and the tokens it cost (summaries and the Batch API's usage)."""

    line: dict[str, Any]
    item_line: int
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def is_ok(self) -> bool:
        return self.line["response"] is not None and self.line["response"]["status_code"] == 200


def sweep_custom_id(custom_id: str, k: int | None) -> str:
    return custom_id if k is None else f"{custom_id}{SWEEP_SUFFIX}{k}"


def parse_input(
    raw_lines: Iterable[bytes],
    *,
    default_model: str | None = None,
    ks: list[int] | None = None,
    urls: tuple[str, ...] = URLS,
    allow_label: bool = False,
    scope: str = "",
) -> ParsedInput:
    """Input lines -> runnable items (one per line and k) and problems. Each line is decoded on its own:
    one line that is not UTF-8 is that line's problem only."""
    parsed, seen = ParsedInput(), set()
    for number, raw_bytes in enumerate(raw_lines, start=1):
        if not raw_bytes.strip():
            continue
        try:
            record = json.loads(raw_bytes.decode("utf-8"))
        except UnicodeDecodeError as exc:
            message = f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"
            parsed.problems.append(LineProblem(number, "invalid_encoding", message))
            continue
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            parsed.problems.append(LineProblem(number, "invalid_json", f"line {number} is not valid JSON: {reason}"))
            continue
        problem = _check_record(record, urls, allow_label)
        if problem is not None:
            message, param = problem
            parsed.problems.append(LineProblem(number, "invalid_request", f"line {number}: {message}", param))
            continue
        custom_id = record["custom_id"]
        if custom_id in seen:
            parsed.duplicates.append(custom_id)
            message = f"line {number}: custom_id {custom_id!r} was already used; this line is not run"
            parsed.problems.append(LineProblem(number, "duplicate_custom_id", message, "custom_id"))
            continue
        seen.add(custom_id)
        body = record["body"]
        model = body.get("model") or default_model
        line_ks: list[int] | list[None] = ks or [None]  # None: the body's own experts_per_token
        for k in line_ks:
            parsed.items.append(BatchItem(number, custom_id, record["url"], body, model, k, record.get("label"), scope))
    return parsed


def read_inputs(path: Path, **options: Any) -> ParsedInput:
    with open(path, "rb") as f:
        return parse_input(f, **options)


def _check_record(record: Any, urls: tuple[str, ...], allow_label: bool) -> tuple[str, str | None] | None:
    """(message, parameter) of what is wrong with a decoded line, or None."""
    if not isinstance(record, dict):
        return "a line must be a JSON object", None
    for name in ("custom_id", "url", "body"):
        if name not in record:
            return f"missing field {name!r}", name
    unknown = sorted(set(record) - set(LINE_FIELDS) - ({"label"} if allow_label else set()))
    if unknown:  # never accepted and ignored
        return f"unknown field {unknown[0]!r}; a line has {', '.join(LINE_FIELDS)}", unknown[0]
    custom_id = record["custom_id"]
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID or not _is_text(custom_id):
        return f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters", "custom_id"
    if record.get("method", "POST") != "POST":
        return f"method must be POST, got {record.get('method')!r}", "method"
    url = record["url"]
    if url not in urls:
        if len(urls) == 1:
            return f"url {url!r} is not the batch's endpoint {urls[0]!r}", "url"
        return f"unknown url {url!r}; supported: {', '.join(urls)}", "url"
    if not isinstance(record["body"], dict):
        return "body must be a JSON object", "body"
    model = record["body"].get("model")
    if model is not None and not (isinstance(model, str) and _is_text(model)):
        return "body.model must be a string", "body.model"
    label = record.get("label")
    if label is not None and not (isinstance(label, str) and _is_text(label)):
        return "label must be a string", "label"
    return None


def _is_text(value: str) -> bool:
    """Whether a JSON string is real text (no lone surrogates, which "\\ud800" escapes can produce)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- output lines ----------------------------------------------------------------------------------


def line_id(key: str, k: int | None, line: int | None = None) -> str:
    """A deterministic id: a rerun gives a line the id it had, which is how a resume recognizes it."""
    return "batch_req_" + hashlib.sha256(f"{key}|{k}|{line}".encode()).hexdigest()[:24]


def error_line(problem: LineProblem) -> dict[str, Any]:
    """The output line of an input line that could not run; its custom_id is `line-<n>` (a duplicate's own
    custom_id already names its answered line)."""
    custom_id = f"line-{problem.line}"
    return {
        "id": line_id(custom_id, None, problem.line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": problem.code, "message": problem.message},
    }


def response_line(item: BatchItem, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An answered line: the body as HTTP would give it (status 200), or its error envelope."""
    return {
        "id": item.line_id,
        "custom_id": item.output_custom_id,
        "response": {"status_code": status, "request_id": item.line_id, "body": body},
        "error": None,
    }


def completed_ids(path: Path) -> set[str]:
    """The ids of the lines already in an output file. A torn last line from a killed run is cut off so
    that the rerun appends cleanly; a file that is not a batch output is refused untouched."""
    if not path.is_file():  # nothing yet, or a device or pipe (-o /dev/stdout): nothing to resume from
        return set()
    data = path.read_bytes()
    complete, torn = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
    ids = set()
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            record = json.loads(raw)
            if not OUTPUT_FIELDS <= set(record) or not isinstance(record["id"], str):
                raise ValueError
        except (ValueError, TypeError):
            raise ValidationError(
                f"output {path} is not a batch output (line {number} is not a result line); give a new file, or "
                "the output of the run to resume",
                parameter="output",
            ) from None
        ids.add(record["id"])
    if torn:
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return ids


def to_json(line: dict[str, Any]) -> str:
    try:
        text = json.dumps(line, ensure_ascii=False)
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from the input: escaped, still valid JSON
        text = json.dumps(line)
    return text


def append(out: Any, line: dict[str, Any]) -> None:
    out.write(to_json(line) + "\n")
    out.flush()  # a kill -9 loses at most the line being written; a rerun cuts it off
