"""A stricter OpenAI-compatible server than vLLM in front of the model: one that refuses the
running-usage field this service asks vLLM for (``stream_options.continuous_usage_stats``).
The service asks it again without the field and answers, and from then on never sends it, so
such an upstream costs one refused request, not every answer."""

from __future__ import annotations

import orjson

from pipeline.model.client import FINAL_USAGE
from tests.conftest import chat_request, make_settings, unique_question
from tests.support.servers import LiveService
from tests.support.strict_gateway import strict_gateway


async def test_an_upstream_that_refuses_the_running_usage_is_answered_without_it(
    make_app, redis_server, vllm
) -> None:
    gateway = strict_gateway(vllm.url)
    with LiveService(gateway) as upstream:
        async with make_app(make_settings(redis_server.url, upstream.url)) as h:
            key = await h.key()
            plain = await h.chat(key, chat_request(unique_question()))
            options = {"stream": True, "stream_options": {"include_usage": True}}
            streamed = await h.chat(key, chat_request(unique_question(), **options))
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] > 0
    assert streamed.status_code == 200, streamed.text
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = [found for event in events[:-1] if (found := orjson.loads(event).get("usage"))]
    assert len(usage) == 1 and usage[0]["completion_tokens"] > 0, usage
    # The first answer's request was refused once and sent again; none sent the field after.
    assert gateway.state.refused == 1
    sent = [body["stream_options"] for body in gateway.state.forwarded]
    assert len(sent) >= 2 and all(options == FINAL_USAGE for options in sent), sent
