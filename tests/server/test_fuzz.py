"""Schemathesis against the served OpenAPI schema: whatever a client sends, the answer is never a 5xx.

Model names are filled in for most cases (a random name only ever reaches the 404 path), so the fuzzer
gets past routing into validation, tokenizing and the engine. Both schema-valid (positive) and schema-invalid
(negative) cases are sent. `make fuzz` runs the same with more examples.
"""

from __future__ import annotations

import collections
import itertools
import os
import random

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("MOE_SERVE_FUZZ_EXAMPLES", "30"))
MODEL_FOR = {"completions": "tiny-lm", "chat": "tiny-lm", "classify": "tiny-clf", "score": "tiny-lm"}


def fill_model(case) -> None:
    """Names a served model of the right task in three cases out of four (seeded by the case itself)."""
    if not isinstance(case.body, dict) or random.Random(repr(case.body)).random() < 0.25:
        return
    for marker, model in MODEL_FOR.items():
        if marker in case.path:
            case.body["model"] = model


def fuzz(operation, mode, seen: collections.Counter) -> None:
    """Sends EXAMPLES generated cases to one operation, counting the answers' statuses."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def call(case) -> None:
        fill_model(case)
        response = case.call(timeout=60)
        assert response.status_code < 500, (operation.label, case.body, response.text[:300])
        seen[mode.value, response.status_code] += 1

    call()


def test_no_request_gets_a_server_error(server) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8
    seen: collections.Counter = collections.Counter()
    for operation, mode in itertools.product(operations, schemathesis.GenerationMode):
        if mode is schemathesis.GenerationMode.POSITIVE or operation.body:  # a GET has nothing to make invalid
            fuzz(operation, mode, seen)
    # The cases reached the engine (200s) and its validation (400s), with both kinds of data.
    assert seen["positive", 200] and seen["positive", 400] and seen["negative", 400] > EXAMPLES
