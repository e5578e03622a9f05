"""OpenAI request bodies as strict pydantic models, and their checks beyond types (each naming its field)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from globalrouter.router_api import MAX_OUTPUT_TOKENS, MAX_TOKEN_ID

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 4096
MAX_USER_LENGTH = 256
INT64 = 2**63


def _unicode(text: str) -> str:
    """Refuses a string that cannot be encoded as UTF-8: JSON's \\ud800 escapes decode to lone
    surrogates, which no tokenizer, log line or protobuf message can carry."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # The message names the position only: error replies never echo request content.
            raise ValueError(f"not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
"""Every string of a request body (each reaches a tokenizer, the pools, or the logs)."""
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)]
Seed = Annotated[int, Field(ge=-INT64, lt=INT64)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]


class _Strict(BaseModel):
    # Strict: "5" is not a number and true is not 1 (OpenAI answers 400 for both). Unknown fields
    # are ignored, as OpenAI-compatible servers do, so newer SDKs keep working.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(_Strict):
    """Fields both endpoints share."""

    model: Annotated[Text, Field(min_length=1, max_length=128)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: int = 1
    user: Annotated[Text, Field(max_length=MAX_USER_LENGTH)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logprobs: Any = None
    logit_bias: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | list[Text] | list[list[TokenId]]
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    top_logprobs: int | None = None


class InvalidField(Exception):
    """A request field is wrong: `param` names it (OpenAI's `param`), `message` says why."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def field_path(loc: tuple[Any, ...]) -> str:
    """pydantic's location as a field path: ("messages", 0, "role") -> "messages[0].role".

    The union member tags pydantic inserts ("str", "list[int]", "constrained-str", a model's class
    name) are not fields and are dropped; field names here are lower-case identifiers."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS or part[0].isupper()):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validates a decoded JSON body into `model`; raises InvalidField naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidField(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # For a union (prompt, stop, content) pydantic reports one error per member; the first one
        # under the shortest path is the clearest to show, unless a value's own check failed (text
        # that is not Unicode inside a list): the member whose type matched says what is wrong.
        checked = [e for e in errors if e["type"] == "value_error"]
        first = min(checked or errors, key=lambda e: len(e["loc"]))
        path = field_path(tuple(first["loc"]))
        raise InvalidField(path or None, f"{path or 'body'}: {first['msg']}") from None


class InvalidJson(Exception):
    """The request body is not JSON (or not UTF-8, or nested too deeply): `message` says where."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def parse_json(model: type[BaseModel], data: bytes) -> Any:
    """Parses and validates a JSON body into `model` in one pass (no intermediate dict); raises
    InvalidJson when it is not JSON, InvalidField naming the first bad field otherwise."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = min(errors, key=lambda e: len(e["loc"]))
        if first["type"] == "json_invalid":
            # pydantic's parser refuses an escaped lone surrogate ("\\ud800") as invalid JSON, with no
            # field named; the standard parser accepts it, so the schema's own check can say which
            # field holds text that is not Unicode. Only bodies already refused are parsed again.
            try:
                body = json.loads(data)
            except (ValueError, RecursionError):
                raise InvalidJson(first["msg"].removeprefix("Invalid JSON: ")) from None
            return parse(model, body)
        if not first["loc"]:
            raise InvalidField(None, "the request body must be a JSON object") from None
        path = field_path(tuple(first["loc"]))
        raise InvalidField(path or None, f"{path or 'body'}: {first['msg']}") from None


def check_supported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuses values this front does not implement, naming the field (never ignores them silently)."""
    if req.n != 1:
        raise InvalidField("n", f"n: only 1 choice per request is supported (got {req.n})")
    if req.logprobs not in (None, False, 0):
        raise InvalidField("logprobs", "logprobs: not supported")
    if req.logit_bias:
        raise InvalidField("logit_bias", "logit_bias: not supported")
    if req.stream_options is not None and not req.stream:
        raise InvalidField("stream_options", "stream_options: only allowed when stream is true")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise InvalidField("echo", "echo: not supported")
        if req.best_of not in (None, 1):
            raise InvalidField("best_of", f"best_of: only 1 is supported (got {req.best_of})")
        if req.suffix:
            raise InvalidField("suffix", "suffix: not supported")
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            if len(req.prompt) != 1:
                raise InvalidField(
                    "prompt", f"prompt: one prompt per request is supported (got {len(req.prompt)})"
                )
        if req.prompt == "" or req.prompt == [""]:
            raise InvalidField("prompt", "prompt: must not be empty")
    else:
        if req.tools:
            raise InvalidField("tools", "tools: tool calling is not supported")
        if req.tool_choice not in (None, "none"):
            raise InvalidField("tool_choice", "tool_choice: tool calling is not supported")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise InvalidField("response_format", "response_format: only type 'text' is supported")
        if req.top_logprobs:
            raise InvalidField("top_logprobs", "top_logprobs: not supported")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            if req.max_tokens != req.max_completion_tokens:
                raise InvalidField(
                    "max_completion_tokens", "max_completion_tokens: differs from max_tokens; set one of them"
                )
        for i, m in enumerate(req.messages):
            if m.role == "tool":
                raise InvalidField(
                    f"messages[{i}].role", f"messages[{i}].role: tool messages are not supported"
                )
        if all(not m.text() for m in req.messages):
            raise InvalidField("messages", "messages: every message is empty")
