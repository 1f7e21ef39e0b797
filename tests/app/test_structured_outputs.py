"""Structured outputs and log probabilities, as a user gets them with the ``openai`` SDK, through
the real service and the real vLLM: ``parse()`` with a Pydantic model (plain and streamed,
retrieval on and off, a cache hit the second time), ``json_object``, logprobs in both modes and
in a cached replay. What the service refuses is in ``test_openai_compat.py``."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from app.main import create_app
from tests.conftest import make_settings
from tests.support.servers import LiveService

DOCUMENTS = [
    {
        "id": "kea",
        "title": "Kea",
        "text": "The kea is a large parrot found in the alpine regions of the South Island of "
        "New Zealand. It is the world's only alpine parrot.",
    },
    {
        "id": "lyon",
        "title": "Lyon",
        "text": "Lyon is a city in France, at the confluence of the Rhone and the Saone.",
    },
]


END = "<|im_end|>"  # SmolLM2's end of turn


class Place(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Bird(BaseModel):
    species: str = Field(max_length=40)
    alpine: bool


PROMPTS: list[tuple[str, type[BaseModel]]] = [
    ("Name a city and its country.", Place),
    ("Which parrot lives in the mountains of New Zealand?", Bird),
    ("Where is Lyon?", Place),
]


class Service:
    def __init__(self, live: LiveService, key: str) -> None:
        self.live = live
        self.key = key
        self.client = openai.OpenAI(
            base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=120
        )


@pytest.fixture(scope="module")
def service(request: pytest.FixtureRequest) -> Iterator[Service]:
    redis_server = request.getfixturevalue("redis_server")
    vllm = request.getfixturevalue("vllm")
    app = create_app(make_settings(redis_server.url, vllm.url))
    with LiveService(app) as live:
        keys = app.state.services.keys
        writer = live.run(keys.create("structured", "ann", frozenset({"chat", "ingest"})))
        response = httpx.post(
            f"{live.url}/v1/documents",
            json={"documents": DOCUMENTS},
            headers={"Authorization": f"Bearer {writer}"},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        yield Service(live, live.run(keys.create("structured", "ann")))


def rag(enabled: bool) -> dict[str, Any]:
    # min_relevance 0: the sources go in whatever the small model's question looks like.
    return {"rag": {"enabled": enabled, "min_relevance": 0.0}}


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


@pytest.mark.parametrize("prompt, model", PROMPTS)
def test_parse_returns_a_parsed_object_and_the_second_call_is_a_cache_hit(
    service: Service, prompt: str, model: type[BaseModel]
) -> None:
    question = prompt  # the service's cache is this module's own: the first call is a miss
    for enabled in (False, True):
        calls = [
            service.client.chat.completions.parse(
                model="smollm2",
                messages=[{"role": "user", "content": question}],
                response_format=model,
                max_tokens=200,
                temperature=0,
                extra_body=rag(enabled),
            )
            for _ in range(2)
        ]
        for completion in calls:
            message = completion.choices[0].message
            assert completion.choices[0].finish_reason == "stop", message.content
            assert isinstance(message.parsed, model), message.content
            assert model.model_validate_json(message.content or "") == message.parsed
        first, second = (extra(c, "rag") for c in calls)
        assert (first["cache"], second["cache"]) == ("miss", "hit")
        assert bool(first["sources"]) is enabled
        assert calls[1].choices[0].message.parsed == calls[0].choices[0].message.parsed


@pytest.mark.parametrize("prompt, model", PROMPTS[:2])
def test_a_streamed_parse_returns_a_parsed_object(
    service: Service, prompt: str, model: type[BaseModel]
) -> None:
    for enabled in (True, False):
        with service.client.chat.completions.stream(
            model="smollm2",
            messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}],
            response_format=model,
            max_tokens=200,
            temperature=0,
            extra_body=rag(enabled),
        ) as stream:
            pieces = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        message = final.choices[0].message
        assert len(pieces) >= 2, "the JSON arrives in pieces"
        assert isinstance(message.parsed, model), message.content
        assert "".join(pieces) == message.content


def test_json_object_returns_valid_json_with_no_code_fence(service: Service) -> None:
    for stream in (False, True):
        # A free JSON object has no end a small model must reach (it may nest until max_tokens):
        # the question asks for a short one; the format makes it JSON, fence-free.
        question = 'Give a JSON object with a "city" key for the capital of France.'
        request: dict[str, Any] = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": question}],
            "response_format": {"type": "json_object"},
            "max_tokens": 200,
            "temperature": 0,
        }
        if stream:
            chunks = list(service.client.chat.completions.create(**request, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            completion = service.client.chat.completions.create(**request)
            text = completion.choices[0].message.content or ""
            finish = completion.choices[0].finish_reason
        assert finish == "stop", text
        assert isinstance(json.loads(text), dict), text
        assert not text.lstrip().startswith("```")


def streamed(service: Service, request: dict[str, Any]) -> tuple[str, list[Any]]:
    """A streamed answer's text, and the logprobs entries its chunks carried."""
    chunks = list(service.client.chat.completions.create(**request, stream=True))
    entries = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or []
    ]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), entries


def test_logprobs_come_back_plain_streamed_and_from_the_cache(service: Service) -> None:
    question = f"Say hello. (ref {uuid.uuid4().hex[:6]})"
    request: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    no_top = {k: v for k, v in request.items() if k != "top_logprobs"}
    plain = [service.client.chat.completions.create(**request) for _ in range(2)]
    assert [extra(c, "rag")["cache"] for c in plain] == ["miss", "hit"]
    for completion in plain:
        choice = completion.choices[0]
        assert choice.logprobs is not None and choice.logprobs.content
        # vLLM also reports the end-of-turn token, which is not text.
        tokens = [entry.token for entry in choice.logprobs.content if entry.token != END]
        assert "".join(tokens) == choice.message.content
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
    assert plain[1].choices[0].logprobs == plain[0].choices[0].logprobs

    text, entries = streamed(service, request)
    assert text == plain[0].choices[0].message.content  # the cached answer, replayed
    assert [e.token for e in entries] == [e.token for e in plain[0].choices[0].logprobs.content]

    fresh = dict(no_top, messages=[{"role": "user", "content": f"Say hi. {uuid.uuid4().hex}"}])
    live_text, live_entries = streamed(service, fresh)
    assert live_entries and "".join(e.token for e in live_entries if e.token != END) == live_text

    without = service.client.chat.completions.create(**{**fresh, "logprobs": False})
    assert without.choices[0].logprobs is None


def test_the_sdk_gets_a_400_naming_each_field_the_service_refuses(service: Service) -> None:
    message = [{"role": "user", "content": "hi"}]
    refused: list[tuple[str, dict[str, Any]]] = [
        ("audio", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text"]}),
        ("modalities", {"modalities": ["text", "audio"]}),
        ("n", {"n": 2}),
        ("reasoning_effort", {"reasoning_effort": "low"}),
        ("prediction", {"prediction": {"type": "content", "content": "x"}}),
        ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
        ("top_k", {"extra_body": {"top_k": 5}}),
    ]
    for field, options in refused:
        with pytest.raises(openai.BadRequestError) as refusal:
            service.client.chat.completions.create(model="smollm2", messages=message, **options)
        error = refusal.value.body
        assert isinstance(error, dict) and error["param"] == field, error
