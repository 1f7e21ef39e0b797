"""``in_unsampled_trace``: where hot paths may skip a span that would be dropped anyway."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

from pipeline.telemetry.spans import in_unsampled_trace


def test_only_a_span_of_an_unsampled_trace_lets_a_child_be_skipped() -> None:
    assert not in_unsampled_trace(), "outside any span a new one is a root: the sampler decides"
    sampled = TracerProvider(sampler=ParentBased(ALWAYS_ON)).get_tracer("t")
    with sampled.start_as_current_span("root"):
        assert not in_unsampled_trace()
    dropped = TracerProvider(sampler=ParentBased(ALWAYS_OFF)).get_tracer("t")
    with dropped.start_as_current_span("root") as root:
        assert not root.is_recording()
        assert in_unsampled_trace()
        # A child made anyway is dropped too: skipping it loses nothing.
        with sampled.start_as_current_span("child") as child:
            assert not child.is_recording()
    # A caller's unsampled trace context (traceparent flags 00) counts as well.
    remote = trace.NonRecordingSpan(
        trace.SpanContext(1, 2, is_remote=True, trace_flags=trace.TraceFlags(0))
    )
    token = otel_context.attach(trace.set_span_in_context(remote))
    try:
        assert in_unsampled_trace()
    finally:
        otel_context.detach(token)
