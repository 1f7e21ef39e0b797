"""OpenAI chat-completions request schema, in OpenAI's field order, plus our one extra: ``rag``.

Unknown OpenAI fields are accepted and ignored, so newer clients keep working. Fields we accept
but cannot honour (``n`` > 1) are refused with a clear 400 rather than ignored. ``tools`` are
checked for shape here (each a function with a valid name); their JSON Schemas are checked by
the validate stage, after auth, within limits and off the event loop
(``pipeline.tools.schema_check``). Bodies reach this model through ``app.http.bodies``, which has
already refused what no part downstream can use (lone surrogates, integers past 64 bits,
non-finite numbers, deep nesting), each with the field's name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from pipeline.context import ChatParams, RagOptions
from pipeline.model.messages import TEXT_PARTS

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_MESSAGES = 2048  # a conversation past this could not fit any context this service serves


# Ids the model reads back: short tokens, so no text rides in them past the guards.
CallId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=256)
    arguments: str


class ToolCallIn(BaseModel):
    """A call the assistant made earlier in the conversation (the model reads it again)."""

    model_config = ConfigDict(extra="ignore")

    id: CallId
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """A message as the model will read it. Only these fields are passed on: other fields of
    OpenAI's messages (``refusal``, ``audio``, ``annotations``, ``function_call``) and unknown
    ones are dropped, so no text reaches the model that the guardrails did not read. Content
    parts must be text parts (``pipeline.model.messages.TEXT_PARTS``): any other type is a 400."""

    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)
    tool_call_id: CallId | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type")
                if kind not in TEXT_PARTS:
                    raise ValueError(
                        f"part {index} has type {kind!r}; this service reads only text parts "
                        f"({', '.join(sorted(TEXT_PARTS))})"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {index} ({kind}) needs a string 'text'")
            # Only the kind and the text go on: a part's other keys are not read by the guards.
            return [{"type": part["type"], "text": part["text"]} for part in content]
        return content


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    """A function the caller offers. Its description and its schema's strings are read by the
    input guards (the chat template shows them to the model); other keys are dropped."""

    model_config = ConfigDict(extra="ignore")

    name: FunctionName
    description: str | None = Field(None, max_length=10_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


MAX_FILTER_KEYS = 64
MAX_FILTER_VALUES = 1024


def _bounded_filters(filters: dict[str, Any] | None) -> dict[str, Any] | None:
    """A metadata filter small enough to parse and match cheaply: at most 64 keys and 1,024
    values in all (a 50,000-key filter once held the event loop for half a second)."""
    if filters is None:
        return None
    if len(filters) > MAX_FILTER_KEYS:
        raise ValueError(f"at most {MAX_FILTER_KEYS} keys, not {len(filters)}")
    values, stack = 0, list(filters.values())
    while stack:
        value = stack.pop()
        values += 1
        if values > MAX_FILTER_VALUES:
            raise ValueError(f"at most {MAX_FILTER_VALUES} values in all")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return filters


Filters = Annotated[dict[str, Any] | None, AfterValidator(_bounded_filters)]


class RagRequestOptions(BaseModel):
    """Server extension: how this request uses retrieval. Typos are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Retrieve passages for this request.")
    top_k: int | None = Field(None, ge=1, le=50, description="Passages put into the prompt.")
    filters: Filters = Field(None, description="Metadata filter, see docs.")
    explain: bool = Field(False, description="Return what each stage did and its duration.")
    route: str | None = Field(
        None, max_length=64, description="Pin a model route (see /v1/models) instead of routing."
    )
    tools: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=32,
        description="Server tools offered to the model for function calling.",
    )
    plan_tools: bool = Field(True, description="Run the tools the request plainly needs.")
    compress: bool | None = Field(None, description="Compress the sources (default: server's).")
    budget_tokens: int | None = Field(
        None, ge=16, le=8192, description="Token budget of the compressed sources."
    )
    min_relevance: float | None = Field(
        None, ge=0.0, le=1.0, description="Relevance a passage needs to enter the prompt."
    )


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str = Field(min_length=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, le=1, description="Only n=1 is supported.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None

    # --- server extension ---
    rag: RagRequestOptions = Field(default_factory=RagRequestOptions)

    @field_validator("messages", mode="before")
    @classmethod
    def _not_too_many(cls, messages: Any) -> Any:
        # Counted before the messages are validated, which would cost as much as they are many.
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages are accepted, not {len(messages)}")
        return messages

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [tool.function.name for tool in tools or []]
        if len(names) != len(set(names)):
            raise ValueError("function names must be distinct")
        return tools

    def sampling(self, default_max_tokens: int | None = None) -> dict[str, Any]:
        """The parameters that decide the answer, exactly as vLLM will be given them."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        values = {
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "max_tokens": max_tokens,
            "presence_penalty": self.presence_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        return {k: v for k, v in values.items() if v is not None}

    def to_params(self, default_top_k: int, default_max_tokens: int | None = None) -> ChatParams:
        return ChatParams(
            model=self.model,
            messages=[m.model_dump(exclude_none=True) for m in self.messages],
            stream=self.stream,
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            sampling=self.sampling(default_max_tokens),
            rag=RagOptions(
                enabled=self.rag.enabled,
                top_k=self.rag.top_k or default_top_k,
                filters=self.rag.filters,
                explain=self.rag.explain,
                route=self.rag.route,
                tools=tuple(self.rag.tools),
                plan_tools=self.rag.plan_tools,
                compress=self.rag.compress,
                budget_tokens=self.rag.budget_tokens,
                min_relevance=self.rag.min_relevance,
            ),
            tools=[t.model_dump(exclude_none=True) for t in self.tools or []],
            tool_choice=(
                self.tool_choice.model_dump()
                if isinstance(self.tool_choice, BaseModel)
                else self.tool_choice
            ),
        )
