"""OpenAI chat-completions request schema, in OpenAI's field order, plus our one extra: ``rag``.

Unknown OpenAI fields are accepted and ignored, so newer clients keep working. Fields we accept
but cannot honour (``n`` > 1) are refused with a clear 400 rather than ignored. ``tools`` are
checked here: each a function with a valid name and a valid JSON Schema for its parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.context import ChatParams, RagOptions
from pipeline.guards.normalize import scrub_surrogates

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: FunctionName
    description: str | None = Field(None, max_length=10_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
            except RecursionError:
                raise ValueError("not a valid JSON Schema: nested too deeply") from None
        return schema


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


class RagRequestOptions(BaseModel):
    """Server extension: how this request uses retrieval. Typos are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Retrieve passages for this request.")
    top_k: int | None = Field(None, ge=1, le=50, description="Passages put into the prompt.")
    filters: dict[str, Any] | None = Field(None, description="Metadata filter, see docs.")
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


def scrub(value: Any) -> Any:
    """``value`` with lone surrogates in its strings replaced by U+FFFD. JSON can carry them
    (``"\\ud800"``) but nothing downstream can encode them (UTF-8, Redis, the tokenizer)."""
    if isinstance(value, str):
        return scrub_surrogates(value)
    if isinstance(value, list):
        return [scrub(item) for item in value]
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    return value


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _scrub(cls, data: Any) -> Any:
        return scrub(data)

    messages: list[ChatMessage] = Field(min_length=1)
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
