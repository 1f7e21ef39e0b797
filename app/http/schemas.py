"""OpenAI chat-completions request schema, in OpenAI's field order, plus our one extra: ``rag``.

Every field of OpenAI's request is honoured, refused or ignored, as ``docs/openai-compatibility.md``
lists (a test reads that table against this module and the ``openai`` SDK's own request type):

- honoured: passed to vLLM (and so part of the cache key, through ``sampling``) or implemented;
- refused: fields that would change the answer and cannot be honoured here (``REFUSED``): a
  non-null value is a 400 with code ``unsupported_parameter`` that names the field and says why;
- ignored: fields that cannot change the answer (``IGNORED``), accepted and logged once per
  process.

A field OpenAI does not have is a 400 (``unknown_parameter``), as OpenAI answers it, so a typo
or a parameter of another server never passes silently. Every value is checked as OpenAI
documents it before anything is queued or sent (``stop``: a string or up to 4; ``logit_bias``:
token ids to -100..100; ``top_logprobs``: 0..20 with ``logprobs``). ``tools`` are checked for
shape here; their JSON Schemas, and ``response_format``'s, by the validate stage, after auth,
within limits and off the event loop (``pipeline.tools.schema_check``). Bodies reach this model
through ``app.http.bodies``, which has already refused what no part downstream can use (lone
surrogates, integers past 64 bits, non-finite numbers, deep nesting), each with the field's name.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pipeline.context import ChatParams, RagOptions
from pipeline.model.messages import TEXT_PARTS, is_text_part

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_MESSAGES = 2048  # a conversation past this could not fit any context this service serves


# Other fields are accepted and dropped (never read); the document lists only the read ones.
LISTED_ONLY = ConfigDict(extra="ignore", json_schema_extra={"additionalProperties": False})

# Ids the model reads back: short tokens, so no text rides in them past the guards.
CallId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCallIn(BaseModel):
    model_config = LISTED_ONLY

    name: str = Field(max_length=256)
    arguments: str


class ToolCallIn(BaseModel):
    """A call the assistant made earlier in the conversation (the model reads it again)."""

    model_config = LISTED_ONLY

    id: CallId
    type: Literal["function"] = "function"
    function: FunctionCallIn


# What ``ChatMessage._text_parts`` accepts, for the document (its own messages are OpenAI's).
CONTENT_SCHEMA: Final[dict[str, Any]] = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"type": {"enum": sorted(TEXT_PARTS)}, "text": {"type": "string"}},
                "required": ["type", "text"],
                "additionalProperties": False,  # accepted, and dropped
            },
        },
        {"type": "null"},
    ]
}


class ChatMessage(BaseModel):
    """A message as the model will read it. Only these fields are passed on: other fields of
    OpenAI's messages (``refusal``, ``audio``, ``annotations``, ``function_call``) and unknown
    ones are dropped, so no text reaches the model that the guardrails did not read. Content
    parts must be text parts (``pipeline.model.messages.TEXT_PARTS``): any other type is a 400."""

    model_config = LISTED_ONLY

    role: Role
    content: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(CONTENT_SCHEMA)] = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128)
    tool_call_id: CallId | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type")
                if not is_text_part(part):
                    shown = repr(kind[:64]) if isinstance(kind, str) else type(kind).__name__
                    raise ValueError(
                        f"part {index} has type {shown}; this service reads only text parts "
                        f"({', '.join(sorted(TEXT_PARTS))})"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {index} ({kind}) needs a string 'text'")
            # Only the kind and the text go on: a part's other keys are not read by the guards.
            return [{"type": part["type"], "text": part["text"]} for part in content]
        return content


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = Field(
        None, description="Ignored: no obfuscation padding is added to the chunks."
    )


# A function's or a response schema's name, as OpenAI allows it.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must follow."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: str | None = Field(None, max_length=10_000)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]
StopSequence = Annotated[str, Field(min_length=1, max_length=1000)]
MAX_LOGIT_BIAS = 300
_TOKEN_ID = re.compile(r"^(0|[1-9][0-9]{0,8})$")


def _token_ids(bias: dict[str, float] | None) -> dict[str, float] | None:
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.match(key):
            raise PydanticCustomError(
                "invalid_value",
                "keys are token ids (whole numbers, as strings), not '{key}'",
                {"key": key[:40]},
            )
        if not -100 <= value <= 100:
            raise PydanticCustomError(
                "invalid_value", "values are from -100 to 100, not {value}", {"value": value}
            )
    return bias


LogitBias = Annotated[
    dict[str, float] | None,
    Field(max_length=MAX_LOGIT_BIAS),
    AfterValidator(_token_ids),
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "maxProperties": MAX_LOGIT_BIAS,
                    "propertyNames": {"pattern": _TOKEN_ID.pattern},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                },
                {"type": "null"},
            ]
        }
    ),
]
# A refused field (``REFUSED``): the document says null, the only value accepted.
Refused = Annotated[Any, WithJsonSchema({"type": "null"})]
TEXT_ONLY: Final = {
    "anyOf": [
        {"type": "null"},
        {"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1},
    ]
}


# Fields of OpenAI's request that would change the answer and cannot be honoured here: a
# non-null value is refused, with the reason.
REFUSED: Final[dict[str, str]] = {
    "audio": "audio output is not supported: the models here write text only",
    "modalities": 'only ["text"] is supported: the models here write text only',
    "prediction": "predicted outputs are not supported by the model server",
    "web_search_options": "web search is not available; offer a server tool in rag.tools",
    "functions": "the deprecated functions field is not supported; send tools",
    "function_call": "the deprecated function_call field is not supported; send tool_choice",
    "reasoning_effort": "the models here do not reason before answering",
    "verbosity": "the models here have no verbosity setting",
    "moderation": "moderation is this service's own guardrails, set per tenant by its operator",
}
# Fields that cannot change the answer: accepted, logged once per process, and otherwise unused.
IGNORED: Final[dict[str, str]] = {
    "store": "completions are not stored for later retrieval (jobs are the stored kind)",
    "metadata": "only used with store",
    "user": "the user is the API key's, for features and the cache; this one is not read",
    "safety_identifier": "abuse monitoring is per API key here",
    "prompt_cache_key": "vLLM's prefix cache needs no key; the response cache keys itself",
    "prompt_cache_options": "vLLM's prefix cache has no options per request",
    "prompt_cache_retention": "vLLM's prefix cache has no retention per request",
    "service_tier": "every request is served at one tier, reported as `default`",
}
_logged_ignored: set[str] = set()
log = logging.getLogger(__name__)


def _refuse(field: str, value: Any) -> None:
    if field == "modalities" and value == ["text"]:
        return
    if value is not None:
        raise PydanticCustomError("unsupported_parameter", REFUSED[field])


def _log_ignored(fields: set[str]) -> None:
    for field in sorted(fields - _logged_ignored):
        _logged_ignored.add(field)  # as vLLM does: once per process, not once per request
        log.info("request field %r is accepted and ignored: %s", field, IGNORED[field])


class FunctionDefinition(BaseModel):
    """A function the caller offers. Its description and its schema's strings are read by the
    input guards (the chat template shows them to the model); other keys are dropped."""

    model_config = LISTED_ONLY

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


_SCALAR: Final = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
_BOUND: Final = {"anyOf": [{"type": "string"}, {"type": "number"}]}
# ``retrieval.filters``'s syntax; its 1,024 values in all are checked, not described.
FILTER_SCHEMA: Final = {
    "anyOf": [
        {
            "type": "object",
            "maxProperties": MAX_FILTER_KEYS,
            "propertyNames": {"minLength": 1, "pattern": "^[^$]"},
            "additionalProperties": {
                "anyOf": [
                    _SCALAR,
                    {
                        "type": "object",
                        "minProperties": 1,
                        "additionalProperties": False,
                        "properties": {
                            "$eq": _SCALAR,
                            "$in": {"type": "array", "items": _SCALAR, "maxItems": 1024},
                            **{op: _BOUND for op in ("$gt", "$gte", "$lt", "$lte")},
                        },
                    },
                ]
            },
        },
        {"type": "null"},
    ]
}
Filters = Annotated[
    dict[str, Any] | None, AfterValidator(_bounded_filters), WithJsonSchema(FILTER_SCHEMA)
]


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
    # top_logprobs needs logprobs: true (``_with_logprobs``), as the document says too.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        },
    )

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str = Field(min_length=1)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias = None
    logprobs: StrictBool | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1, json_schema_extra={"maximum": 1})
    parallel_tool_calls: StrictBool | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's bounds
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = Field(None, gt=0, le=1)

    # Refused when set (REFUSED says why); any JSON is read only to say so.
    audio: Refused = Field(None, description=REFUSED["audio"])
    modalities: Annotated[Any, WithJsonSchema(TEXT_ONLY)] = None
    prediction: Refused = Field(None, description=REFUSED["prediction"])
    web_search_options: Refused = Field(None, description=REFUSED["web_search_options"])
    functions: Refused = Field(None, description=REFUSED["functions"])
    function_call: Refused = Field(None, description=REFUSED["function_call"])
    reasoning_effort: Refused = Field(None, description=REFUSED["reasoning_effort"])
    verbosity: Refused = Field(None, description=REFUSED["verbosity"])
    moderation: Refused = Field(None, description=REFUSED["moderation"])

    # Ignored (IGNORED says why).
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = Field(None, max_length=64)
    service_tier: str | None = Field(None, max_length=64)

    # --- server extension ---
    rag: RagRequestOptions = Field(default_factory=RagRequestOptions)

    ignored: ClassVar[frozenset[str]] = frozenset(IGNORED)

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        _refuse(info.field_name, value)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _at_most_four_stops(cls, stop: Any) -> Any:
        # Before the union is tried, so the error names `stop` itself, not a member of it.
        if isinstance(stop, list) and len(stop) > 4:
            raise PydanticCustomError("too_long", "at most 4 items (stop sequences)")
        if stop is not None and not isinstance(stop, str | list):
            raise PydanticCustomError("string_type", "a string or a list of up to 4 strings")
        return stop

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n > 1:
            raise PydanticCustomError(
                "unsupported_parameter",
                "only one choice per request is supported (n=1); send the request n times",
            )
        return n

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true")
        return top

    @field_validator("stream_options")
    @classmethod
    def _when_streamed(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream"):  # as OpenAI refuses it
            raise PydanticCustomError(
                "invalid_value", "stream_options is only allowed when stream is true"
            )
        return options

    @model_validator(mode="after")
    def _note_ignored(self) -> ChatCompletionRequest:
        _log_ignored({name for name in self.ignored if getattr(self, name) is not None})
        return self

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
        response_format = self.response_format
        values = {
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "logprobs": self.logprobs or None,
            "max_tokens": max_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "presence_penalty": self.presence_penalty,
            # "text" is the default: left out, so it shares the cache with requests without it.
            "response_format": (
                response_format.model_dump(by_alias=True, exclude_none=True)
                if response_format is not None and response_format.type != "text"
                else None
            ),
            "seed": self.seed,
            "stop": self.stop,
            "temperature": self.temperature,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
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
