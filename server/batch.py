"""`moe-serve batch`: OpenAI Batch JSONL in, one result line per (input, k) out; resumable; batched.

Input lines: {"custom_id", "method": "POST", "url", "body"} for /v1/completions, /v1/chat/completions,
/v1/classify and /v1/score (an optional top-level "label" marks a classify line's true class for
quality-vs-k). Output lines: {"id", "custom_id", "experts_per_token", "response": {"status_code",
"request_id", "body"}, "error"}. A line that cannot be run (invalid JSON, unknown url, duplicate
custom_id) becomes one error line; a body that fails validation gets a 400 response naming the field.

Resume: the output is appended and flushed line by line; a rerun reads it, drops a torn last line, and
skips every (custom_id, k) already answered.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
from tqdm.auto import tqdm

from moe_serve.config import EngineConfig
from moe_serve.errors import MoEServeError, ValidationError
from moe_serve.llm import LLM
from moe_serve.sampling_params import SamplingParams
from server import protocol as p
from server.errors import validation_message
from server.serving import completion_logprobs, render_chat, usage

REQUEST_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/classify": p.ClassifyRequest,
    "/v1/score": p.ScoreRequest,
}
MAX_TOKENS_CAP = 4096


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


@dataclass(slots=True)
class Summary:
    lines: int = 0
    requests: int = 0
    skipped: int = 0
    errors: int = 0
    duplicates: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


# ---- reading --------------------------------------------------------------------------------------


def read_inputs(path: Path, default_model: str | None, ks: list[int] | None) -> tuple[list[BatchItem], list[dict], list[str]]:
    """-> runnable items (one per line and k), error lines for lines that cannot run, duplicate ids."""
    items, errors, duplicates, seen = [], [], [], set()
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as exc:
                errors.append(_error_line(f"line-{number}", None, "invalid_json", f"line {number} is not valid JSON: {exc.msg}", number))
                continue
            problem = _check_record(record)
            custom_id = str(record.get("custom_id", f"line-{number}")) if isinstance(record, dict) else f"line-{number}"
            if problem:
                errors.append(_error_line(custom_id, None, "invalid_request", f"line {number}: {problem}", number))
                continue
            if custom_id in seen:
                duplicates.append(custom_id)
                errors.append(_error_line(custom_id, None, "duplicate_custom_id", f"line {number}: custom_id {custom_id!r} was already used; this line is not run", number))
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
    if record.get("method", "POST") != "POST":
        return f"method must be POST, got {record.get('method')!r}"
    if record["url"] not in REQUEST_MODELS:
        return f"unknown url {record['url']!r}; supported: {', '.join(REQUEST_MODELS)}"
    if not isinstance(record["body"], dict):
        return "body must be a JSON object"
    return None


def completed_keys(path: Path) -> set[tuple[str, int | None]]:
    """(custom_id, k) pairs already in the output (error lines by their line number); a torn last line
    from a killed run is cut off so that the rerun appends cleanly."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    keys = set()
    for raw in data.decode("utf-8").splitlines():
        record = json.loads(raw)
        line = (record.get("error") or {}).get("line")
        keys.add((f"#line-{line}", None) if line is not None else (record["custom_id"], record.get("experts_per_token_sweep")))
    return keys


def _error_line(custom_id: str, k: int | None, code: str, message: str, line: int) -> dict:
    return {"id": _line_id(custom_id, k, line), "custom_id": custom_id, "experts_per_token_sweep": k, "response": None,
            "error": {"code": code, "message": message, "line": line}}


def _line_id(custom_id: str, k: int | None, line: int | None = None) -> str:
    return "batch_req_" + hashlib.sha256(f"{custom_id}|{k}|{line}".encode()).hexdigest()[:24]


# ---- running --------------------------------------------------------------------------------------


class ModelPool:
    """Each model loaded once per process (a Ray worker holds its own pool)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self._models: dict[str, LLM] = {}

    def get(self, name: str) -> LLM:
        if name not in self._models:
            self._models[name] = LLM(name, self.engine_config)
        return self._models[name]


def process_chunk(pool: ModelPool, items: list[BatchItem]) -> list[dict]:
    """Answer a chunk of items: requests of the same model and url run as one batched call."""
    groups: dict[tuple[str | None, str], list[BatchItem]] = defaultdict(list)
    for item in items:
        groups[(item.model, item.url)].append(item)
    results: dict[int, dict] = {}
    for (model, url), group in groups.items():
        if model is None:
            for item in group:
                results[id(item)] = _response(item, 400, _error_body("model is required (in the body or with --model)", "model"))
            continue
        try:
            llm = pool.get(model)
        except MoEServeError as exc:
            for item in group:
                results[id(item)] = _response(item, 404, _error_body(str(exc), "model", "not_found_error"))
            continue
        runner = {"/v1/completions": _completions, "/v1/chat/completions": _completions, "/v1/classify": _classify, "/v1/score": _score}[url]
        results.update(runner(llm, model, group))
    return [results[id(item)] for item in items]


def _parse(item: BatchItem) -> pydantic.BaseModel:
    body = dict(item.body)
    if item.k is not None:
        body["experts_per_token"] = item.k
    try:
        return REQUEST_MODELS[item.url].model_validate(body)
    except pydantic.ValidationError as exc:
        message, param = validation_message(exc)  # type: ignore[arg-type]  # same .errors() interface
        raise ValidationError(message, parameter=param) from None


def _completions(llm: LLM, model: str, group: list[BatchItem]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    owners: list[tuple[BatchItem, Any, int]] = []  # (item, request, number of prompts)
    for item in group:
        try:
            request = _parse(item)
            if item.url == "/v1/chat/completions":
                item_prompts = [llm.tokenizer.encode(render_chat(llm.artifact, request.messages))]  # type: ignore[attr-defined]
                sampling = request.to_sampling_params(MAX_TOKENS_CAP)  # type: ignore[attr-defined]
            else:
                sampling = request.to_sampling_params(MAX_TOKENS_CAP, request.logprobs)  # type: ignore[attr-defined]
                item_prompts = [llm.engine.encode_text(x, "prompt") if isinstance(x, str) else list(x) for x in request.prompts()]  # type: ignore[attr-defined]
            for ids in item_prompts:
                llm.engine.check_request(ids, sampling)
        except ValidationError as exc:
            results[id(item)] = _response(item, 400, _error_body(str(exc), exc.parameter))
            continue
        owners.append((item, request, len(item_prompts)))
        prompts += item_prompts
        params += [sampling] * len(item_prompts)
    outputs = llm.generate(prompts, params) if prompts else []
    start = 0
    for item, request, count in owners:
        mine, start = outputs[start : start + count], start + count
        k = mine[0].experts_per_token
        prompt_tokens = sum(len(o.prompt_token_ids) for o in mine)
        completion_tokens = sum(o.num_generated_tokens for o in mine)
        totals = usage(prompt_tokens, completion_tokens, k)
        if item.url == "/v1/chat/completions":
            choices = [p.ChatChoice(index=c.index, message=p.ChatMessageOut(content=c.text), finish_reason=c.finish_reason) for c in mine[0].outputs]
            body = p.ChatCompletionResponse(id=_line_id(item.custom_id, item.k), model=model, choices=choices, usage=totals)
        else:
            n = len(mine[0].outputs)
            choices = [
                p.CompletionChoice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason,
                                   logprobs=completion_logprobs(llm.tokenizer, c.token_ids, c.logprobs or [], c.top_logprobs or [], request.logprobs))  # type: ignore[attr-defined]
                for i, o in enumerate(mine) for c in o.outputs
            ]
            body = p.CompletionResponse(id=_line_id(item.custom_id, item.k), model=model, choices=choices, usage=totals)
        results[id(item)] = _response(item, 200, body.model_dump(), prompt_tokens, completion_tokens)
    return results


def _pooled(llm: LLM, model: str, group: list[BatchItem], kind: str) -> dict[int, dict]:
    results: dict[int, dict] = {}
    texts: list[str] = []
    ks: list[int | None] = []
    owners: list[tuple[BatchItem, Any, int, int | None, int]] = []  # (item, request, inputs, k, prompt tokens)
    for item in group:
        try:
            request = _parse(item)
            inputs = [request.input] if isinstance(request.input, str) else list(request.input)  # type: ignore[attr-defined]
            if not inputs:
                raise ValidationError("input must not be empty", parameter="input")
            k = llm.engine.resolve_experts_per_token(request.experts_per_token)  # type: ignore[attr-defined]
            num_tokens = 0
            for text in inputs:
                ids = llm.engine.encode_text(text, "input")
                if kind == "score" and len(ids) < 2:
                    raise ValidationError("input must have at least 2 tokens to be scored", parameter="input")
                num_tokens += len(ids)
        except ValidationError as exc:
            results[id(item)] = _response(item, 400, _error_body(str(exc), exc.parameter))
            continue
        reported = k if llm.config.moe else None
        owners.append((item, request, len(inputs), reported, num_tokens))
        texts += inputs
        ks += [reported] * len(inputs)
    if kind == "classify":
        outputs = llm.classify(texts, ks) if texts else []  # type: ignore[arg-type]
    else:
        outputs = llm.score(texts, ks, return_token_logprobs=True) if texts else []  # type: ignore[arg-type]
    start = 0
    for item, request, count, k, prompt_tokens in owners:
        mine, start = outputs[start : start + count], start + count
        totals = usage(prompt_tokens, 0, k, any(o.approximate for o in mine) if kind == "classify" else None)
        if kind == "classify":
            body = p.ClassifyResponse(model=model, data=[p.Classification(index=i, label=o.label, probs=o.probs) for i, o in enumerate(mine)], usage=totals)
        else:
            keep = request.return_token_logprobs  # type: ignore[attr-defined]
            data = [p.Score(index=i, total_logprob=o.total_logprob, num_tokens=o.num_tokens, num_bytes=o.num_bytes,
                            bits_per_byte=o.bits_per_byte, token_logprobs=o.token_logprobs if keep else None) for i, o in enumerate(mine)]
            body = p.ScoreResponse(model=model, data=data, usage=totals)
        results[id(item)] = _response(item, 200, body.model_dump(), prompt_tokens, 0)
    return results


def _classify(llm: LLM, model: str, group: list[BatchItem]) -> dict[int, dict]:
    return _pooled(llm, model, group, "classify")


def _score(llm: LLM, model: str, group: list[BatchItem]) -> dict[int, dict]:
    return _pooled(llm, model, group, "score")


def _error_body(message: str, param: str | None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": 400 if type_ == "invalid_request_error" else 404}}


def _response(item: BatchItem, status: int, body: dict, prompt_tokens: int = 0, completion_tokens: int = 0) -> dict:
    k = item.k if item.k is not None else ((body.get("usage") or {}).get("experts_per_token"))
    line = {
        "id": _line_id(item.custom_id, item.k),
        "custom_id": item.custom_id,
        "experts_per_token": k,
        "experts_per_token_sweep": item.k,
        "response": {"status_code": status, "request_id": _line_id(item.custom_id, item.k), "body": body},
        "error": None,
        "_tokens": (prompt_tokens, completion_tokens),
    }
    if item.label is not None:
        line["label"] = item.label
    return line


# ---- the driver -----------------------------------------------------------------------------------


ChunkRunner = Callable[[list[list[BatchItem]]], Iterable[list[dict]]]


def run_batch(
    input_path: Path,
    output_path: Path,
    *,
    default_model: str | None = None,
    ks: list[int] | None = None,
    engine_config: EngineConfig | None = None,
    chunk_size: int = 64,
    progress: bool = True,
    chunk_runner: ChunkRunner | None = None,
) -> tuple[Summary, list[dict]]:
    """Run (or resume) a batch file. Returns the summary and the result lines written by this run."""
    started = time.monotonic()
    items, error_lines, duplicates = read_inputs(input_path, default_model, ks)
    done = completed_keys(output_path)
    summary = Summary(lines=len({i.line for i in items}) + len(error_lines), duplicates=duplicates)
    pending = [i for i in items if i.key not in done]
    fresh_errors = [e for e in error_lines if (f"#line-{e['error']['line']}", None) not in done]
    summary.skipped = len(items) - len(pending)
    chunks = [pending[start : start + chunk_size] for start in range(0, len(pending), chunk_size)]
    if chunk_runner is None:
        pool = ModelPool(engine_config or EngineConfig())
        chunk_runner = lambda chunks_: (process_chunk(pool, c) for c in chunks_)  # noqa: E731
    written: list[dict] = []
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out, tqdm(total=len(pending), desc="batch", unit="req", disable=not progress) as bar:
        for line in fresh_errors:
            _append(out, line)
            summary.errors += 1
            written.append(line)
        for lines in chunk_runner(chunks):
            for line in lines:
                prompt_tokens, completion_tokens = line.pop("_tokens", (0, 0))
                summary.prompt_tokens += prompt_tokens
                summary.completion_tokens += completion_tokens
                summary.errors += line["response"]["status_code"] != 200
                _append(out, line)
                written.append(line)
            summary.requests += len(lines)
            bar.update(len(lines))
            bar.set_postfix(tok_s=f"{(summary.prompt_tokens + summary.completion_tokens) / max(time.monotonic() - started, 1e-9):.0f}")
    summary.seconds = time.monotonic() - started
    return summary, written


def _append(out: Any, line: dict) -> None:
    out.write(json.dumps(line, ensure_ascii=False) + "\n")
    out.flush()  # a kill -9 loses at most the line being written; a rerun cuts it off


def quality_rows(output_path: Path, dataset: str) -> list[dict]:
    """Quality vs k from a batch sweep's output: accuracy of labelled classify lines, bits per byte of
    score lines, per (model, k)."""
    correct: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    score: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for raw in output_path.read_text(encoding="utf-8").splitlines():
        line = json.loads(raw)
        response = line.get("response") or {}
        if response.get("status_code") != 200 or line.get("experts_per_token") is None:
            continue
        body, key = response["body"], (response["body"]["model"], line["experts_per_token"])
        if body.get("object") == "list" and body["data"] and "label" in body["data"][0] and line.get("label") is not None:
            correct[key][0] += body["data"][0]["label"] == line["label"]
            correct[key][1] += 1
        elif body.get("object") == "list" and body["data"] and "bits_per_byte" in body["data"][0]:
            for item in body["data"]:
                score[key][0] += -item["total_logprob"] / math.log(2)
                score[key][1] += item["num_bytes"]
    rows = [{"model": m, "dataset": dataset, "k": k, "metric": "accuracy", "value": c / n} for (m, k), (c, n) in correct.items() if n]
    rows += [{"model": m, "dataset": dataset, "k": k, "metric": "bits_per_byte", "value": bits / nbytes} for (m, k), (bits, nbytes) in score.items() if nbytes]
    return sorted(rows, key=lambda r: (r["model"], r["metric"], r["k"]))

