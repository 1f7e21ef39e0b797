"""The audit of OpenAI's chat-completions fields (docs/openai-compatibility.md), checked: the
tables list every field of the ``openai`` SDK's request and response types; each request field
is honoured, refused or ignored as the table says (real requests, chat and jobs); every value
is validated before anything reaches vLLM; every honoured field that changes the answer is in
the cache key; the response carries what the table says it carries."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from app.http import schemas
from app.http.schemas import IGNORED, REFUSED, ChatCompletionRequest
from app.main import create_app
from pipeline.context import Principal
from pipeline.stages.cache import cache_key
from tests.app.test_errors import assert_openai_error
from tests.conftest import chat_request, make_settings, unique_question
from tests.support.servers import LiveService

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-compatibility.md"
ROW = re.compile(r"^\| `([a-z_.]+)` \| (\w+) \|", re.MULTILINE)


def table(section: str) -> dict[str, str]:
    text = DOC.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return dict(ROW.findall(text[start : end if end > 0 else None]))


REQUEST = table("Request")
RESPONSE = table("Response")


def with_status(status: str) -> set[str]:
    return {name for name, value in REQUEST.items() if value == status}


def sdk_request_fields() -> set[str]:
    # `stream` is declared on the SDK's streaming and non-streaming subtypes.
    return set(CompletionCreateParamsBase.__annotations__) | {"stream"}


def sdk_response_fields() -> set[str]:
    fields = set(ChatCompletion.model_fields)
    fields |= {f"choices.{name}" for name in Choice.model_fields}
    fields |= {f"message.{name}" for name in ChatCompletionMessage.model_fields}
    fields |= {f"usage.{name}" for name in CompletionUsage.model_fields}
    return fields


def test_the_request_table_lists_every_field_of_the_sdks_request_and_no_other() -> None:
    assert set(REQUEST) == sdk_request_fields()
    assert set(REQUEST.values()) == {"honoured", "refused", "ignored"}


def test_the_request_table_agrees_with_the_schema() -> None:
    fields = set(ChatCompletionRequest.model_fields) - {"rag"}
    assert with_status("honoured") | with_status("refused") | with_status("ignored") == fields
    assert with_status("refused") == set(REFUSED)
    assert with_status("ignored") == set(IGNORED)


def test_the_response_table_lists_every_field_of_the_sdks_response() -> None:
    assert sdk_response_fields() <= set(RESPONSE)
    assert set(RESPONSE.values()) == {"present", "absent"}


@pytest.fixture
async def harness(make_app, redis_server, vllm):
    async with make_app(make_settings(redis_server.url, vllm.url)) as h:
        yield h


REFUSED_VALUES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "moderation": {"input": {"mode": "block"}},
}


def test_every_refused_field_has_an_example() -> None:
    assert set(REFUSED_VALUES) == set(REFUSED)


async def submit(harness: Any, key: str, body: dict[str, Any]) -> Any:
    return await harness.client.post(
        "/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"}
    )


async def test_each_refused_field_is_a_400_that_names_it_in_chat_and_in_jobs(harness) -> None:
    key = await harness.key(scopes="chat")
    for field, value in [*REFUSED_VALUES.items(), ("n", 2)]:
        body = chat_request(unique_question(), **{field: value})
        for response in (await harness.chat(key, body), await submit(harness, key, body)):
            error = assert_openai_error(response, 400, "invalid_request_error")
            assert (error["param"], error["code"]) == (field, "unsupported_parameter"), error
            assert field in error["message"]
    # null is "not given", as the SDK leaves it out; ["text"] is what is served.
    fine = chat_request(unique_question(), audio=None, modalities=["text"], n=1)
    assert (await harness.chat(key, fine)).status_code == 200


@pytest.mark.parametrize(
    "field, value, param, code",
    [
        ("top_k", 5, "top_k", "unknown_parameter"),  # vLLM's, not OpenAI's
        ("temprature", 0.5, "temprature", "unknown_parameter"),
        ("stop", ["a", "b", "c", "d", "e"], "stop", None),
        ("stop", "", "stop", None),
        ("top_logprobs", 2, "top_logprobs", "invalid_value"),  # without logprobs
        ("logprobs", "yes", "logprobs", None),
        ("logit_bias", {"the": 5}, "logit_bias", "invalid_value"),
        ("logit_bias", {"5": 150}, "logit_bias", "invalid_value"),
        ("frequency_penalty", 2.5, "frequency_penalty", None),
        ("response_format", {"type": "xml"}, "response_format", None),
        ("response_format", {"type": "json_schema"}, "response_format", None),
        ("stream_options", {"include_usage": True, "extra": 1}, "stream_options.extra", None),
        ("stream_options", {"include_usage": True}, "stream_options", "invalid_value"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": 12}}},
            "response_format.json_schema.schema",
            "invalid_response_schema",
        ),
    ],
)
async def test_bad_values_are_refused_here_before_anything_is_queued_or_sent(
    harness, field: str, value: Any, param: str, code: str | None
) -> None:
    key = await harness.key(scopes="chat")
    body = chat_request(unique_question(), **{field: value})
    for response in (await harness.chat(key, body), await submit(harness, key, body)):
        error = assert_openai_error(response, 400, "invalid_request_error")
        assert error["param"] is not None and error["param"].startswith(param), error
        if code is not None:
            assert error["code"] == code, error
    assert not [s for s in harness.exporter.get_finished_spans() if s.name.startswith("chat ")]


async def test_a_refusal_that_still_comes_from_vllm_is_our_error_with_a_code(harness) -> None:
    # Token ids are checked for shape here; the vocabulary is the model server's to know.
    key = await harness.key()
    body = chat_request(unique_question(), logit_bias={"999999999": 5})
    error = assert_openai_error(await harness.chat(key, body), 400, "invalid_request_error")
    assert (error["code"], error["param"]) == ("upstream_rejected", "logit_bias"), error
    assert error["message"].startswith("The model server refused the request:"), error


async def test_ignored_fields_are_accepted_and_logged_once(
    harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(schemas, "_logged_ignored", set())
    key = await harness.key()
    values = {
        "store": True,
        "metadata": {"a": "b"},
        "user": "u-1",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k",
        "prompt_cache_options": {"mode": "implicit"},
        "prompt_cache_retention": "24h",
        "service_tier": "flex",
    }
    assert set(values) == set(IGNORED)
    with caplog.at_level(logging.INFO, logger="app.http.schemas"):
        for _ in range(2):
            response = await harness.chat(key, chat_request(unique_question(), **values))
            assert response.status_code == 200, response.text
            assert response.json()["service_tier"] == "default"
    logged = [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]
    assert sorted(m.split("'")[1] for m in logged) == sorted(IGNORED)


# Each honoured field, set to a value that changes the answer (on top of BASE).
BASE: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
VARIANTS: dict[str, dict[str, Any]] = {
    "messages": {"messages": [{"role": "user", "content": "hello"}]},
    "model": {"model": "other"},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 1}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 7},
    "max_tokens": {"max_tokens": 9},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "presence_penalty": {"presence_penalty": 0.5},
    "response_format": {"response_format": {"type": "json_object"}},
    "seed": {"seed": 1},
    "stop": {"stop": ["x"]},
    "temperature": {"temperature": 0.7},
    "tool_choice": {"tool_choice": "none"},
    "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.5},
}
# Honoured fields that do not change the answer's content, and why.
SAME_ANSWER = {
    "stream": "the same answer, delivered as chunks",
    "stream_options": "whether the last chunk carries usage",
    "n": "only n=1 is served",
}


def key_of(**fields: Any) -> str:
    params = ChatCompletionRequest(**{**BASE, **fields}).to_params(4, 512)
    return cache_key(params, Principal("acme", "alice", frozenset({"chat"}), "k"), "v1")


def test_every_honoured_field_that_changes_the_answer_is_in_the_cache_key() -> None:
    assert set(VARIANTS) | set(SAME_ANSWER) == with_status("honoured")
    base = key_of()
    for field, variant in VARIANTS.items():
        compared = key_of(logprobs=True) if field == "top_logprobs" else base
        assert key_of(**variant) != compared, field
    # `text` is the default format: it shares entries with requests that leave it out.
    assert key_of(response_format={"type": "text"}) == base
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    other = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array"}}}
    assert key_of(response_format=schema) != key_of(response_format=other)


async def test_the_response_carries_what_the_table_says(harness) -> None:
    key = await harness.key()
    body = (await harness.chat(key, chat_request(unique_question()))).json()
    parts = {
        "": body,
        "choices": body["choices"][0],
        "message": body["choices"][0]["message"],
        "usage": body["usage"],
    }
    for name, status in RESPONSE.items():
        group, _, field = name.rpartition(".")
        if name in ("message.tool_calls",):  # only when the model calls a client function
            continue
        assert (field in parts[group]) is (status == "present"), name


def test_the_sdk_reads_every_answers_and_errors_request_id(redis_server, vllm) -> None:
    # The table said `id` was also the `x-request-id` header; no response had it, so the SDK's
    # `_request_id` and `APIStatusError.request_id` were always None.
    app = create_app(make_settings(redis_server.url, vllm.url))
    with LiveService(app) as live:
        key = live.run(app.state.services.keys.create("sdk-ids", "dan"))
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)
        question = [{"role": "user", "content": unique_question()}]
        extra = {"rag": {"enabled": False}}
        asked = {"model": "smollm2", "messages": question, "max_tokens": 4, "extra_body": extra}
        for _ in range(3):  # a miss, then hits (the fast path's among them)
            completion = client.chat.completions.create(**asked)  # type: ignore[call-overload]
            assert completion._request_id == completion.id
        with client.chat.completions.with_streaming_response.create(
            **asked, stream=True
        ) as streamed:
            chunks = list(streamed.parse())
            assert {c.id for c in chunks} == {streamed.headers["x-request-id"]}
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(**{**asked, "model": "no-such-model"})
        trace_id = refused.value.response.headers["x-trace-id"]
        assert refused.value.request_id == f"req_{trace_id}"
