"""The batch file formats: reading input lines into runnable items (or error lines), output lines, and
what a previous (possibly killed) run already wrote.

Input lines: {"custom_id", "method": "POST", "url", "body"} for /v1/completions, /v1/chat/completions,
/v1/classify and /v1/score (an optional top-level "label" marks a classify line's true class for
quality-vs-k). Output lines: {"id", "custom_id", "experts_per_token", "experts_per_token_sweep",
"response": {"status_code", "request_id", "body"}, "error"}. A line that cannot be run (invalid JSON,
unknown url, duplicate custom_id) becomes one error line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_serve.errors import ValidationError

URLS = ("/v1/completions", "/v1/chat/completions", "/v1/classify", "/v1/score")
MAX_CUSTOM_ID = 512


@dataclass(slots=True)
class BatchItem:
    line: int
    custom_id: str
    url: str
    body: dict[str, Any]
    model: str | None
    k: int | None  # the sweep's k (None: the body's own experts_per_token)
    label: str | None = None

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.custom_id, self.k)

    @property
    def line_id(self) -> str:
        return line_id(self.custom_id, self.k)


def read_inputs(
    path: Path, default_model: str | None, ks: list[int] | None
) -> tuple[list[BatchItem], list[dict], list[str]]:
    """-> runnable items (one per line and k), error lines for lines that cannot run, duplicate ids."""
    items, errors, duplicates, seen = [], [], [], set()
    with open(path, "rb") as f:  # decoded line by line: one line that is not UTF-8 is that line's error
        for number, raw_bytes in enumerate(f, start=1):
            if not raw_bytes.strip():
                continue
            try:
                record = json.loads(raw_bytes.decode("utf-8"))
            except UnicodeDecodeError as exc:
                message = f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})"
                errors.append(error_line(f"line-{number}", "invalid_encoding", message, number))
                continue
            except (json.JSONDecodeError, RecursionError) as exc:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                errors.append(
                    error_line(f"line-{number}", "invalid_json", f"line {number} is not valid JSON: {reason}", number)
                )
                continue
            problem = _check_record(record)
            custom_id = record["custom_id"] if problem is None else f"line-{number}"
            if problem:
                errors.append(error_line(custom_id, "invalid_request", f"line {number}: {problem}", number))
                continue
            if custom_id in seen:
                duplicates.append(custom_id)
                message = f"line {number}: custom_id {custom_id!r} was already used; this line is not run"
                errors.append(error_line(custom_id, "duplicate_custom_id", message, number))
                continue
            seen.add(custom_id)
            body = record["body"]
            model = body.get("model") or default_model
            for k in ks or [None]:
                items.append(BatchItem(number, custom_id, record["url"], body, model, k, record.get("label")))
    return items, errors, duplicates


def _check_record(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "a line must be a JSON object"
    for name in ("custom_id", "url", "body"):
        if name not in record:
            return f"missing field {name!r}"
    custom_id = record["custom_id"]
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID or not _is_text(custom_id):
        return f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters"
    if record.get("method", "POST") != "POST":
        return f"method must be POST, got {record.get('method')!r}"
    if record["url"] not in URLS:
        return f"unknown url {record['url']!r}; supported: {', '.join(URLS)}"
    if not isinstance(record["body"], dict):
        return "body must be a JSON object"
    model = record["body"].get("model")
    if model is not None and not (isinstance(model, str) and _is_text(model)):
        return "body.model must be a string"
    label = record.get("label")
    if label is not None and not (isinstance(label, str) and _is_text(label)):
        return "label must be a string"
    return None


def _is_text(value: str) -> bool:
    """Whether a JSON string is real text (no lone surrogates, which "\\ud800" escapes can produce)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def completed_keys(path: Path) -> set[tuple[str, int | None]]:
    """(custom_id, k) pairs already in the output (error lines by their line number). A torn last line
    from a killed run is cut off so that the rerun appends cleanly; a file that is not a batch output is
    refused untouched."""
    if not path.is_file():  # nothing yet, or a device or pipe (-o /dev/stdout): nothing to resume from
        return set()
    data = path.read_bytes()
    complete, torn = data[: data.rfind(b"\n") + 1], data[data.rfind(b"\n") + 1 :]
    keys = set()
    for number, raw in enumerate(complete.splitlines(), start=1):
        try:
            record = json.loads(raw)
            line = (record.get("error") or {}).get("line")
            keys.add(error_key(line) if line is not None else (record["custom_id"], record["experts_per_token_sweep"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValidationError(
                f"output {path} is not a batch output (line {number} is not a result line); give a new file, or "
                "the output of the run to resume",
                parameter="output",
            ) from None
    if torn:
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    return keys


def error_key(line: int) -> tuple[str, None]:
    return (f"#line-{line}", None)


def error_line(custom_id: str, code: str, message: str, line: int) -> dict:
    return {
        "id": line_id(custom_id, None, line),
        "custom_id": custom_id,
        "experts_per_token_sweep": None,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }


def response_line(item: BatchItem, status: int, body: dict, prompt_tokens: int = 0, completion_tokens: int = 0) -> dict:
    """An answered line; `_tokens` is popped by the driver for the summary before the line is written."""
    k = item.k if item.k is not None else (body.get("usage") or {}).get("experts_per_token")
    line = {
        "id": item.line_id,
        "custom_id": item.custom_id,
        "experts_per_token": k,
        "experts_per_token_sweep": item.k,
        "response": {"status_code": status, "request_id": item.line_id, "body": body},
        "error": None,
        "_tokens": (prompt_tokens, completion_tokens),
    }
    if item.label is not None:
        line["label"] = item.label
    return line


def line_id(custom_id: str, k: int | None, line: int | None = None) -> str:
    return "batch_req_" + hashlib.sha256(f"{custom_id}|{k}|{line}".encode()).hexdigest()[:24]


def append(out: Any, line: dict) -> None:
    try:
        text = json.dumps(line, ensure_ascii=False)
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from the input: escaped, still valid JSON
        text = json.dumps(line)
    out.write(text + "\n")
    out.flush()  # a kill -9 loses at most the line being written; a rerun cuts it off
