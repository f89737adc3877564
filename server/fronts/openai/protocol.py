"""OpenAI request bodies (pydantic) and their translation into the gRPC API's GenerateRequest.

The translation only moves fields: every check of a value (ranges, limits, sizes) is the
RequestValidator's, as for a gRPC call, and its errors are renamed to the OpenAI field that
carried the value (max_new_tokens -> max_tokens, text -> prompt, ...).
"""
from __future__ import annotations

import dataclasses

import json
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from specserve.proto import generate_pb2 as pb
from specserve.server.errors import InvalidRequest
from specserve.server.fronts.openai.chat_outputs import ChatOutputMode
from specserve.server.generation import Served
from specserve.server.text.schema_checks import check_json_schema
from specserve.server.text.tool_calls import required_calls_schema
from specserve.server.text.validation import ValidatedRequest


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormatBody(BaseModel):
    """OpenAI's response_format: text (the default), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(BaseModel):
    """vLLM's structured_outputs extra: one of json (a schema), regex, choice (the output is one
    of the strings), grammar (EBNF) or json_object. Its other options (whitespace_pattern,
    structural_tag, ...) are refused by name: the output would not be what they ask for."""

    model_config = ConfigDict(extra="forbid")

    json_: Optional[Union[dict[str, Any], str]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def grammars(self, prefix: str) -> list[tuple[str, pb.StructuredOutput]]:
        """(option, its grammar) for each option given; errors name `{prefix}{option}`."""
        given = []
        if self.json_ is not None:
            given.append(("json", pb.StructuredOutput(
                json_schema=self.json_ if isinstance(self.json_, str) else json.dumps(self.json_))))
        if self.regex is not None:
            given.append(("regex", pb.StructuredOutput(regex=self.regex)))
        if self.choice is not None:
            given.append(("choice", pb.StructuredOutput(
                ebnf=choice_grammar(self.choice, f"{prefix}choice"))))
        if self.grammar is not None:
            given.append(("grammar", pb.StructuredOutput(ebnf=self.grammar)))
        if self.json_object:
            given.append(("json_object", pb.StructuredOutput(json_object=True)))
        return given


def choice_grammar(choices: list[str], field: str) -> str:
    """EBNF whose only sentences are the strings: an alternation of string literals (JSON's
    escapes are the grammar's: quotes, backslashes and control characters)."""
    if not choices:
        raise InvalidRequest(f"{field}: give at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GenerationBody(BaseModel):
    """Fields that completions and chat share. Unknown fields are ignored, as OpenAI's server
    does, so that clients sending newer fields still work."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted for compatibility; not used
    n: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (as a JSON key) -> bias
    # SGLang and vLLM extras.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    # Structured outputs: OpenAI's response_format, SGLang's regex / ebnf extras, vLLM's
    # structured_outputs; at most one of them.
    response_format: Optional[ResponseFormatBody] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    # vLLM's older spelling of structured_outputs' options (removed in its 0.12).
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None  # refused (check_supported)

    PROMPT_FIELD: ClassVar[str]  # the field that holds the prompt, for error messages
    IS_CHAT: ClassVar[bool] = False
    # The request field whose grammar the request carries (for errors naming it).
    _grammar_field: str = PrivateAttr(default="response_format")

    def structured_output(self) -> Optional[pb.StructuredOutput]:
        """The grammar this body asks for, as the gRPC API's message (None: free text)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            fmt = self.response_format
            if fmt.type == "json_object":
                given.append(("response_format", pb.StructuredOutput(json_object=True)))
            else:
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise InvalidRequest("response_format: json_schema.schema is required for "
                                         "type json_schema")
                given.append(("response_format.json_schema.schema", pb.StructuredOutput(
                    json_schema=json.dumps(fmt.json_schema.schema_))))
        if self.regex is not None:
            given.append(("regex", pb.StructuredOutput(regex=self.regex)))
        if self.ebnf is not None:
            given.append(("ebnf", pb.StructuredOutput(ebnf=self.ebnf)))
        if self.structured_outputs is not None:
            options = self.structured_outputs.grammars("structured_outputs.")
            if len(options) > 1:
                raise InvalidRequest("structured_outputs: give one of json, regex, choice, grammar "
                                     "or json_object")
            given += [("structured_outputs", grammar) for _, grammar in options]
        guided = StructuredOutputsBody(json=self.guided_json, regex=self.guided_regex,
                                       choice=self.guided_choice, grammar=self.guided_grammar)
        given += [(f"guided_{option}", grammar) for option, grammar in guided.grammars("guided_")]
        if len(given) > 1:
            raise InvalidRequest(f"{given[1][0]}: only one of response_format, regex, ebnf, "
                                 f"structured_outputs and guided_* may be given")
        if not given:
            return None
        self._grammar_field = given[0][0]
        return given[0][1]

    def grammar_field(self) -> str:
        """The request field that holds the grammar (the engine's errors about it name
        structured_output.*). Prepare found it too, but maybe in a tokenizer worker process."""
        self.structured_output()
        return self._grammar_field

    def check_supported(self) -> None:
        """Refuse, by name, what the server does not implement (rather than ignore it)."""
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequest("guided_whitespace_pattern: not supported (JSON outputs are "
                                 "one line, with \", \" and \": \" separators)")

    @property
    def num_choices(self) -> int:
        return self.n if self.n is not None else 1

    def logprob_fields(self) -> dict:
        """The gRPC logprobs / top_logprobs / prompt_logprobs values this body asks for."""
        return {}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprob_fields().get("logprobs"))

    @property
    def echo_text(self) -> Optional[str]:
        """The prompt's text to put before the completion (completions' echo)."""
        return None

    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The request field that limits the completion's length."""
        return "max_tokens"

    def sampling(self) -> pb.SamplingParams:
        """The sampling fields as the gRPC API's message; unset fields stay unset, so their
        defaults are the gRPC API's."""
        values = {"max_new_tokens": self.max_new_tokens(), "min_new_tokens": self.min_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                  "seed": self.seed, "ignore_eos": self.ignore_eos, "n": self.n,
                  "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, **self.logprob_fields()}
        msg = pb.SamplingParams(stop=[self.stop] if isinstance(self.stop, str) else self.stop or [])
        for key, bias in (self.logit_bias or {}).items():
            try:
                msg.logit_bias[int(key)] = bias
            except (ValueError, TypeError):
                raise InvalidRequest(f"logit_bias: {key!r} is not a token id") from None
        for name, value in values.items():
            if value is None:
                continue
            try:
                setattr(msg, name, value)
            except (ValueError, TypeError):  # outside the wire type's range (e.g. negative)
                raise InvalidRequest(f"{name}: {value!r} is out of range") from None
        try:
            msg.stop_token_ids.extend(self.stop_token_ids or [])
        except (ValueError, TypeError):
            raise InvalidRequest(f"stop_token_ids: {self.stop_token_ids!r} has an id out of "
                                 f"range") from None
        return msg

    def api_field(self, field: str) -> str:
        """The OpenAI field for a gRPC field name."""
        if field.partition(".")[0] == "structured_output":  # the gRPC API's field
            return self._grammar_field
        return {"max_new_tokens": self.max_tokens_field(), "min_new_tokens": "min_tokens",
                "text": self.PROMPT_FIELD, "token_ids": self.PROMPT_FIELD}.get(field, field)

    def prepare(self, served: Served) -> ValidatedRequest:
        """The validated request (runs in a prepare thread: templating and tokenizing)."""
        try:
            self.check_supported()
            return served.validator.validate(self.generate_request(served), chat=self.IS_CHAT)
        except InvalidRequest as e:
            field, _, rest = str(e).partition(":")
            raise InvalidRequest(f"{self.api_field(field)}:{rest}") from None

    def generate_request(self, served: Served) -> pb.GenerateRequest:
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationBody):
    prompt: Union[str, list[int]]
    # The k most likely tokens at each position, with the chosen one's log-probability (the
    # legacy API's int; 0 returns the chosen tokens' alone).
    logprobs: Optional[int] = None
    echo: bool = False  # the prompt before the completion (and its logprobs, with logprobs)
    suffix: Optional[str] = None

    PROMPT_FIELD = "prompt"
    _echo_text: Optional[str] = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise InvalidRequest("suffix: not supported")

    def logprob_fields(self) -> dict:
        if self.logprobs is None:
            return {}
        fields = {"logprobs": True, "top_logprobs": self.logprobs}
        if self.echo:
            fields["prompt_logprobs"] = self.logprobs
        return fields

    def api_field(self, field: str) -> str:
        return "logprobs" if field in ("top_logprobs", "prompt_logprobs") else super().api_field(field)

    def prepare(self, served: Served) -> ValidatedRequest:
        validated = super().prepare(served)
        if self.echo:  # decoded here, where the request is prepared, off the event loop
            echo_text = self.prompt if isinstance(self.prompt, str) else \
                served.token_texts.decode(validated.prompt_token_ids)
            validated = dataclasses.replace(validated, echo_text=echo_text)
        return validated

    def on_prepared(self, validated: ValidatedRequest) -> None:
        """Keep what prepare found (it may have run in a tokenizer worker process)."""
        self._echo_text = validated.echo_text

    @property
    def echo_text(self) -> Optional[str]:
        """The prompt's text when echo is set (known once prepare ran)."""
        return self._echo_text

    def generate_request(self, served: Served) -> pb.GenerateRequest:
        grammar = self.structured_output()
        if isinstance(self.prompt, str):
            return pb.GenerateRequest(text=self.prompt, sampling=self.sampling(),
                                      structured_output=grammar)
        request = pb.GenerateRequest(sampling=self.sampling(), structured_output=grammar)
        try:
            request.token_ids.ids.extend(self.prompt)
        except (ValueError, TypeError):
            raise InvalidRequest("token_ids: a token id is out of range") from None
        return request


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the template

    role: str
    content: Optional[Union[str, list[TextPart]]] = None

    def for_template(self) -> dict:
        """The message as templates read it: content as one string (parts joined)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class FunctionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ToolBody(BaseModel):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[ToolBody]] = None
    # Unset: "auto" with tools, "none" without.
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True   # False: tool_choice "required" makes exactly one call

    PROMPT_FIELD = "messages"
    IS_CHAT = True

    def check_supported(self) -> None:
        super().check_supported()
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise InvalidRequest("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice) and \
                choice.function.name not in {t.function.name for t in self.tools}:
            raise InvalidRequest(f"tool_choice: no tool is named {choice.function.name!r}")
        for i, tool in enumerate(self.tools or ()):  # under any tool_choice: the model sees them
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters")
        if self.forces_calls and self.structured_output() is not None:
            raise InvalidRequest(f"{self._grammar_field}: cannot be combined with tool_choice "
                                 f"required or a named function (the calls' schema is the grammar)")

    @property
    def effective_tool_choice(self):
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_calls(self) -> bool:
        return self.effective_tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def chat_mode(self, served: Served) -> ChatOutputMode:
        """How the choices' text becomes reasoning, content and tool calls."""
        choice = self.effective_tool_choice
        return ChatOutputMode(
            reasoning_parser=served.reasoning_parser,
            tool_call_parser=served.tool_call_parser if choice == "auto" else None,
            forced_calls=self.forces_calls,
            forced_name=choice.function.name if isinstance(choice, NamedToolChoice) else None)

    def _forced_grammar(self) -> Optional[pb.StructuredOutput]:
        """tool_choice required or named: the calls' JSON schema."""
        choice = self.effective_tool_choice
        if isinstance(choice, NamedToolChoice):
            i = next(i for i, t in enumerate(self.tools) if t.function.name == choice.function.name)
            schema = self.tools[i].function.parameters or {"type": "object"}
            self._grammar_field = f"tools[{i}].function.parameters"
        elif choice == "required":
            schema = required_calls_schema([t.function.model_dump(exclude_none=True) for t in self.tools],
                                           self.parallel_tool_calls)
            self._grammar_field = "tools"
        else:
            return None
        return pb.StructuredOutput(json_schema=json.dumps(schema))

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def grammar_field(self) -> str:
        return self._grammar_field if self._forced_grammar() is not None else super().grammar_field()

    def logprob_fields(self) -> dict:
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    def max_new_tokens(self) -> Optional[int]:
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def generate_request(self, served: Served) -> pb.GenerateRequest:
        # Rendered here rather than sent as GenerateRequest.messages: OpenAI messages carry more
        # than role and content (name, tool_calls, ...), and templates read those too. The text
        # carries the template's special tokens (a BOS) already.
        # The template sees the tools unless tool_choice is "none" (the model is not to call any).
        tools = [t.model_dump(exclude_none=True) for t in self.tools] \
            if self.tools and self.effective_tool_choice != "none" else None
        text = served.validator.chat_prompt([m.for_template() for m in self.messages], tools=tools)
        return pb.GenerateRequest(text=text, add_special_tokens=False, sampling=self.sampling(),
                                  structured_output=self._forced_grammar() or self.structured_output())


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt or a conversation (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True

    def token_ids(self, served: Served) -> list[int]:
        """The ids a completion or chat request with this prompt would be given (runs in a
        prepare thread), by the same code as the gRPC Tokenize call."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("prompt: give either prompt or messages")
        prompt = (self.prompt if self.messages is None
                  else [m.for_template() for m in self.messages])
        return served.validator.tokenize_prompt(prompt, self.add_special_tokens,
                                                self.add_generation_prompt, text_field="prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]

    def text(self, served: Served) -> str:
        """The decoded text (runs in a prepare thread), by the same code as gRPC Detokenize."""
        return served.validator.detokenize(self.tokens, field="tokens")
