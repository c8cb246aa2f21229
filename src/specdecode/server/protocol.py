"""The OpenAI request schemas, and how a request body becomes one.

A body is read as UTF-8 JSON (no NaN / Infinity, no lone UTF-16 surrogates in any string,
nesting within the json module's recursion limit), its arrays are checked against
the context length (`check_sizes`), then it is validated against the endpoint's schema. The
checks are ordered cheapest first and scale with what the body holds only where they must: a
body that is one long string, or a long array of numbers, costs one json.loads. Every error
names the field by its JSON path (`messages[0].content`) in plain words.
Unknown fields are refused, and so is every OpenAI parameter this server does not implement
unless it has its neutral value (`echo: false`, `n: 1`, ...): nothing a client asks for is
silently ignored.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import PydanticCustomError

# Only a \u escape can make json.loads return a lone surrogate (UTF-8 has none): only a body
# that has one is walked value by value to find where. (A number too large for a double, 1e999,
# parses as inf, which no field of the schemas accepts.)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class APIError(Exception):
    """An answer that is an OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_path(loc) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(value) -> str:
    """A short, safe description of a JSON value for an error message (strings are not echoed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value) if abs(value) < 10 ** 30 else f"a {len(str(abs(value)))}-digit integer"
        return text
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# ---- the body ---------------------------------------------------------------------------------

def _no_constant(name: str):
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number; send a finite number")


def parse_body(body: bytes) -> dict:
    """The request body as a JSON object, checked as the module docstring says."""
    if not body.strip():
        raise APIError(400, 'the request body is empty: send a JSON object, e.g. {"model": "...", "prompt": "..."}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (the byte at offset {e.start} cannot start or "
                       "continue a character); JSON must be sent as UTF-8") from None
    text = text.removeprefix("\ufeff")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {describe(data)}")
    if _SURROGATE_ESCAPE.search(text):
        _check_strings(data)
    return data


def _check_strings(data: dict) -> None:
    """Valid Unicode in every key and string of a parsed body, with the path of the first
    that is not (iterative: no recursion on nesting)."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not key.isascii():
                _check_text(key, path, "a key in ")
            if isinstance(item, str):
                if not item.isascii():
                    _check_text(item, path + (key,))
            elif isinstance(item, (list, dict)):
                stack.append((item, path + (key,)))


def check_sizes(data: dict, max_items: int) -> None:
    """Refuse, before the schema is validated, an array longer than `max_items` (the context
    length) where the schema takes one: no prompt of token ids, conversation, text-part list or
    list of stops that long can be served, and validating it first would take time."""
    def check(value, path: str) -> None:
        if isinstance(value, list) and len(value) > max_items:
            raise APIError(400, f"{path} has {len(value)} items, more than fit: this model's context is "
                           f"{max_items} tokens", param=path)

    for key in ("prompt", "messages", "stop", "stop_token_ids"):
        value = data.get(key)
        check(value, key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                check(item, f"{key}[{i}]")  # a batch of prompts
                if key == "messages" and isinstance(item, dict):
                    check(item.get("content"), f"messages[{i}].content")


def _check_text(text: str, path: tuple, prefix: str = "") -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = json_path(path) or "the body"
        raise APIError(400, f"{prefix}{where} contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at "
                       f"character {e.start}); strings must be valid Unicode", param=json_path(path) or None) from None


# ---- schemas ------------------------------------------------------------------------------------

class _Strict(BaseModel):
    """JSON types as sent: no "1" for 1, no true for 1, no 1.0 for an integer; unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


def _one_of(expected: str, **branches):
    """A union picked by the value's JSON kind (`branches`: tag -> (type, predicate)), so an
    error comes from the branch the value was meant for, or says `expected`."""

    def pick(value):
        return next((tag for tag, (_, matches) in branches.items() if matches(value)), None)

    members = tuple(Annotated[kind, Tag(tag)] for tag, (kind, _) in branches.items())
    return Annotated[Union[members], Discriminator(pick, custom_error_type="one_of", custom_error_message=expected)]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_list_of(check):
    return lambda v: isinstance(v, list) and bool(v) and check(v[0])


# Tags of _one_of branches start with '#': error locations drop them.
Stop = _one_of("must be a string or an array of strings",
               **{"#str": (str, lambda v: isinstance(v, str)), "#list": (list[str], lambda v: isinstance(v, list))})
Prompt = _one_of(
    "must be a string, an array of token ids (integers), or a batch of one prompt",
    **{"#text": (str, lambda v: isinstance(v, str)),
       "#ids": (list[int], lambda v: isinstance(v, list) and (not v or _is_number(v[0]))),
       "#texts": (list[str], _is_list_of(lambda x: isinstance(x, str))),
       "#nested": (list[list[int]], _is_list_of(lambda x: isinstance(x, list)))})


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, value):
        if isinstance(value, dict) and "type" in value and value["type"] != "text":
            kind = value["type"]
            raise PydanticCustomError("content_part", "is a content part of type {kind}; only 'text' parts are supported",
                                      {"kind": repr(kind) if isinstance(kind, str) else describe(kind)})
        return value


Content = _one_of("must be a string or an array of text parts ({\"type\": \"text\", \"text\": \"...\"})",
                  **{"#str": (str, lambda v: isinstance(v, str)),
                     "#parts": (Annotated[list[TextPart], Field(min_length=1)], lambda v: isinstance(v, list))})


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Content
    name: str | None = None  # passed to the chat template

    def text(self) -> str:
        """Text parts are joined with newlines (as vLLM does)."""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # usage always comes in the last chunk


_NOT_SUPPORTED = "not supported by this server; refused unless it has its neutral value"
_MAX_LOGPROBS = 20


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object (one of its fields)."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Request(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, description="default: whatever fits, max_model_len - prompt tokens")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and not used")
    n: Any = Field(None, description="only 1")
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description="vLLM's; 1 = off")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit")
    bad_words: list[str] | None = Field(None, description="vLLM's: words the output never contains")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's structured outputs")
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="vLLM's: a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: a Lark or GBNF grammar the output follows")


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS, description="logprobs of the N likeliest tokens too")
    prompt_logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS, description="vLLM's: logprobs of prompt tokens")
    echo: Any = Field(None, description=_NOT_SUPPORTED + " (false)")
    suffix: Any = Field(None, description=_NOT_SUPPORTED + ' ("")')
    best_of: Any = Field(None, description=_NOT_SUPPORTED + " (1)")


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1, description="the same as max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=_MAX_LOGPROBS, description="with logprobs: the N likeliest tokens too")
    tools: Any = Field(None, description=_NOT_SUPPORTED + " ([])")
    tool_choice: Any = Field(None, description=_NOT_SUPPORTED + ' ("none")')
    parallel_tool_calls: Any = Field(None, description=_NOT_SUPPORTED)
    functions: Any = Field(None, description=_NOT_SUPPORTED + " ([])")
    function_call: Any = Field(None, description=_NOT_SUPPORTED + ' ("none")')


# parameter -> (its neutral values besides null, why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "only n=1 is supported: send n requests instead (with seeds s, s+1, ... for distinct samples); "
                "they are batched together, at the cost of one"),
    "best_of": ((1,), "best_of > 1 is not supported: send several requests and pick by their logprobs"),
    "echo": ((False,), "echo is not supported: answers never repeat the prompt"),
    "suffix": (("",), "suffix (text after the insertion point) is not supported"),
    "tools": (([],), "tool calling is not supported (tools)"),
    "tool_choice": (("none",), "tool calling is not supported (tool_choice)"),
    "parallel_tool_calls": ((True, False), "tool calling is not supported (parallel_tool_calls)"),
    "functions": (([],), "function calling is not supported (functions)"),
    "function_call": (("none",), "function calling is not supported (function_call)"),
}


def _neutral(value, neutrals: tuple) -> bool:
    return value is None or any(type(value) is type(n) and value == n for n in neutrals)


def validate(schema: type[_Request], data: dict) -> _Request:
    """The body as `schema`, or an APIError naming the first field that is wrong."""
    try:
        req = schema.model_validate(data)
    except ValidationError as e:
        message, param = _message(e.errors(include_url=False)[0])
        raise APIError(400, message, param=param) from None
    for name, (neutrals, why) in UNSUPPORTED.items():
        if name in schema.model_fields and not _neutral(getattr(req, name), neutrals):
            raise APIError(400, f"{why}; got {name}={describe(getattr(req, name))}", param=name)
    return req


_TEMPLATES = {
    "missing": "{path} is required",
    "string_type": "{path} must be a string, got {got}",
    "int_type": "{path} must be an integer, got {got}",
    "bool_type": "{path} must be true or false, got {got}",
    "float_type": "{path} must be a number, got {got}",
    "finite_number": "{path} must be a finite number",
    "list_type": "{path} must be an array, got {got}",
    "dict_type": "{path} must be an object, got {got}",
    "model_type": "{path} must be an object, got {got}",
    "model_attributes_type": "{path} must be an object, got {got}",
    "too_short": "{path} must have at least {min_length} item(s)",
    "greater_than_equal": "{path} must be >= {ge}, got {got}",
    "greater_than": "{path} must be > {gt}, got {got}",
    "less_than_equal": "{path} must be <= {le}, got {got}",
    "less_than": "{path} must be < {lt}, got {got}",
    "literal_error": "{path} must be one of {expected}, got {got}",
}


def _message(err: dict) -> tuple[str, str | None]:
    loc = [x for x in err["loc"] if not (isinstance(x, str) and x.startswith("#"))]
    path = json_path(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        what = "parameter" if len(loc) == 1 else "field"
        return f"{path} is not a supported {what} (this server does not implement it)", path
    template = _TEMPLATES.get(kind)
    if template is None:  # our own errors (one_of, content_part) read as "<path> <msg>"
        return f"{path} {err['msg']}" if path else err["msg"], path or None
    try:
        return template.format(path=path, got=describe(err.get("input")), **err.get("ctx", {})), path or None
    except (KeyError, IndexError):
        return f"{path}: {err['msg']}", path or None


def request_schema(schema: type[BaseModel]) -> tuple[dict, dict]:
    """(the OpenAPI requestBody of `schema`, its component schemas) for /docs."""
    full = schema.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = full.pop("$defs", {})
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}}}
    return body, {schema.__name__: full, **defs}
