"""OpenAI request bodies -> GenerationRequest (prompts and SamplingParams), and the API's errors.

Bodies are validated by pydantic in strict mode ("0.5" is not a number). Unknown fields are ignored,
as vLLM does; known fields of the wrong type, out-of-range values and features corelm does not have
raise APIError, whose message is a fixed text naming the parameter: values and user text are never
echoed back (llama.cpp PR#9210: "error messages are supposed to be fixed strings").
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import SamplingParams
from ..engine.guided import GuidedMatcher, StructuredOutputsParams, UnsatisfiableConstraint
from ..engine.llm_engine import SAMPLING_DEFAULT_KEYS
from ..engine.sampling import MAX_LOGIT_BIAS
from .errors import APIError, bad_request
from .reasoning import PROMPT_TAIL_TOKENS, prompt_opens_thought, template_thinks
from .tools import ToolConfig, check_tools, template_messages_tool_calls

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
MAX_N = 16                  # choices per request (n x prompts)
MAX_LOGPROBS = 20           # OpenAI's top_logprobs limit
# Stop strings are searched for after every token, on the engine thread that serves every client, so a
# request may bring only a few short ones (OpenAI allows 4; vLLM sets no limit).
MAX_STOP = 16
MAX_STOP_CHARS = 256


# ---------------------------------------------------------------------------------------------------
# Errors

def unsupported(param: str, message: Optional[str] = None) -> APIError:
    """A field corelm cannot honour: refused, never silently ignored."""
    return bad_request(message or f"'{param}' is not supported.", param, code="unsupported_parameter")


# Fixed descriptions of each sampling parameter's valid values (SamplingParams' own messages quote the
# value, so they are not passed on).
_RANGES = {
    "n": "an integer from 1 to {max_n} (and 1 when temperature is 0)",
    "temperature": "a number from 0 to 2",
    "top_p": "a number in (0, 1]",
    "top_k": "an integer: 0 or -1 (disabled), or at least 1",
    "min_p": "a number in [0, 1]",
    "repetition_penalty": "a number > 0",
    "presence_penalty": "a number in [-2, 2]",
    "frequency_penalty": "a number in [-2, 2]",
    "seed": "an integer",
    "stop": "a non-empty string or a list of non-empty strings",   # the limits: _check_stop
    "stop_token_ids": "a list of token ids inside the vocabulary",
    "ignore_eos": "a boolean",
    "max_tokens": "an integer >= 1",
    "max_thinking_tokens": "an integer: -1 (no limit), 0 (no thinking) or a number of tokens",
    "min_tokens": "an integer >= 0 and <= max_tokens",
    "logprobs": "an integer from 0 to {max_logprobs}",
    "skip_special_tokens": "a boolean",
    "include_stop_str_in_output": "a boolean",
    "logit_bias": f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) inside the vocabulary, "
                  "each mapped to a number in [-100, 100]",
}


def sampling_error(exc: ValueError, rename: Optional[Dict[str, str]] = None) -> APIError:
    """SamplingParams' ValueError -> a 400 naming the parameter, with a fixed message."""
    text = str(exc)
    for name in sorted(_RANGES, key=len, reverse=True):
        if text.startswith(name):
            param = (rename or {}).get(name, name)
            valid = _RANGES[name].format(max_n=MAX_N, max_logprobs=MAX_LOGPROBS)
            return bad_request(f"Invalid value for '{param}': it must be {valid}.", param)
    return bad_request("Invalid sampling parameters.")


def validation_error(exc: ValidationError) -> APIError:
    """pydantic's error -> a 400 naming the top-level field (never the input, which is user text)."""
    errors = exc.errors(include_input=False, include_url=False)
    if not errors:
        return bad_request("Invalid request body.")
    err = errors[0]
    kind = err.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return bad_request("The request body is not valid JSON.", code="invalid_json")
    if not err.get("loc"):          # the body itself (a nested object of the wrong type names its field)
        return bad_request("The request body must be a JSON object.")
    param = str(err["loc"][0])
    if kind == "missing":
        return bad_request(f"Missing required parameter '{param}'.", param)
    return bad_request(f"Invalid type or value for '{param}'.", param)


# ---------------------------------------------------------------------------------------------------
# Request bodies

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


Number = Union[int, float]  # strict mode: JSON numbers only, no strings


class _Sampling(_Body):
    """Fields shared by both endpoints, OpenAI's and vLLM's extras (top_k, min_p, ...)."""
    model: Optional[str] = None
    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[Dict[str, Number]] = None
    user: Optional[str] = None
    # vLLM's extra sampling parameters (the openai client sends them through extra_body)
    top_k: Optional[int] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    max_thinking_tokens: Optional[int] = None    # reasoning models: the thinking budget (engine/thinking.py)
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[Union[int, str, List[int]]]]   # a prompt, token ids, or a list of either
    max_tokens: Optional[int] = 16          # OpenAI's default for completions
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TextPart(_Body):
    type: str
    text: Optional[str] = None


class FunctionCall(_Body):
    name: str
    arguments: str          # JSON text, as OpenAI writes it


class ToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None          # an assistant's earlier calls
    tool_call_id: Optional[str] = None                   # a tool message: the call it answers


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[List[Any]] = None   # the deprecated form of tools
    chat_template_kwargs: Optional[Dict[str, Any]] = None   # vLLM's: extra chat template variables


BODIES = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest}


# ---------------------------------------------------------------------------------------------------
# Body -> GenerationRequest

Prompt = Union[str, List[int]]


@dataclass
class GenerationRequest:
    """One validated body, ready for an engine: chat requests carry one conversation (`messages`),
    completions one or more `prompts` (text or token ids); each prompt gets params.n choices, choice
    index = prompt index * n + k."""
    chat: bool
    params: SamplingParams
    prompts: List[Prompt]
    messages: Optional[List[Dict[str, str]]] = None
    stream: bool = False
    include_usage: bool = False
    model: Optional[str] = None
    max_tokens_param: str = "max_tokens"    # the body field params.max_tokens came from
    echo: bool = False                      # completions: each choice starts with its prompt's text
    suffix: Optional[str] = None            # completions: fill in the middle between prompt and suffix
    template_kwargs: Optional[Dict[str, Any]] = None   # chat: extra chat template variables
    prompt_ids: Optional[List[List[int]]] = None       # set by encode_prompts
    tools: Optional[ToolConfig] = None                 # chat: the tools, and how calls are parsed
    reasoning: Optional[bool] = None   # chat, set by encode_prompts: None no thought parsing, True the prompt opened one
    unset: frozenset = frozenset()     # sampling fields the body left out: the model's defaults apply (encode_prompts)

    @property
    def prompt_param(self) -> str:
        """The body field prompt errors are reported against."""
        return "messages" if self.chat else "prompt"

    @property
    def num_choices(self) -> int:
        return self.params.n * (1 if self.chat else len(self.prompts))


def parse_body_as(model, body: Union[bytes, str, Dict[str, Any]]):
    """A body (JSON text, or already parsed) validated as the pydantic `model`; APIError (400) naming the field."""
    try:
        return model.model_validate(body) if isinstance(body, dict) else model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def parse_request(url: str, body: Union[bytes, str, Dict[str, Any]]) -> GenerationRequest:
    """A body (JSON text, or already parsed) for `url` -> GenerationRequest; APIError when it is
    invalid or asks for something corelm does not do. Needs no model."""
    req = parse_body_as(BODIES[url], body)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if isinstance(req, ChatCompletionRequest):
        tools = check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        template_kwargs = check_template_kwargs(req.chat_template_kwargs)
        if tools is not None:
            template_kwargs = {**(template_kwargs or {}), "tools": tools.tools}
        return GenerationRequest(True, _chat_params(req, tools), [], _chat_messages(req), req.stream, include_usage,
                                 req.model, "max_completion_tokens" if req.max_completion_tokens is not None
                                 else "max_tokens", template_kwargs=template_kwargs, tools=tools,
                                 unset=_unset_sampling(req))
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of", "'best_of' must equal 'n' (or be omitted).")
    params = _sampling_params(req, req.max_tokens, req.logprobs, {})
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and all(isinstance(p, int) for p in prompts)):
        prompts = [prompts]
    elif len({isinstance(p, str) for p in prompts}) > 1 or any(isinstance(p, int) for p in prompts):
        # [1, "a"], [[1], "a"]: all text or all token ids, as vLLM's schema has it
        raise bad_request("'prompt' mixes token ids and prompts.", "prompt")
    if not prompts or len(prompts) * params.n > MAX_N:
        raise bad_request(f"Give from 1 to {MAX_N} prompts (times 'n').", "prompt")
    if req.suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise bad_request("'suffix' needs text prompts, not token ids.", "suffix")
    return GenerationRequest(False, params, list(prompts), None, req.stream, include_usage, req.model,
                             echo=req.echo, suffix=req.suffix, unset=_unset_sampling(req))


def _unset_sampling(req: _Sampling) -> frozenset:
    """The sampling fields a model may set defaults for (vLLM's) that the body left out."""
    return frozenset(k for k in SAMPLING_DEFAULT_KEYS if getattr(req, k) is None)


# Variables the server itself gives the chat template; chat_template_kwargs may not replace them.
_TEMPLATE_RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents", "bos_token",
                                "eos_token"})
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(kwargs: Optional[Dict[str, Any]],
                          param: str = "chat_template_kwargs") -> Optional[Dict[str, Any]]:
    """Per-request chat template variables ({"enable_thinking": false}): at most MAX_TEMPLATE_KWARGS,
    named like identifiers, none of the variables the server sets. Their strings count towards the
    render's budget like the messages' do."""
    if not kwargs:
        return None
    if len(kwargs) > MAX_TEMPLATE_KWARGS or any(not k.isidentifier() or k.startswith("_") or k in _TEMPLATE_RESERVED
                                                for k in kwargs):
        raise bad_request(f"Invalid value for '{param}': give at most {MAX_TEMPLATE_KWARGS} variables named like "
                          "identifiers, other than messages, add_generation_prompt, tools, documents, bos_token "
                          "and eos_token.", param)
    return dict(kwargs)


def _chat_params(req: ChatCompletionRequest, tools: Optional[ToolConfig]) -> SamplingParams:
    if req.functions:
        raise unsupported("functions")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    rename = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
              "logprobs": "top_logprobs"}
    guide = tools.guide() if tools is not None and tools.forced else None
    return _sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, rename, guide)


def _chat_messages(req: ChatCompletionRequest) -> List[Dict[str, Any]]:
    messages = []
    for m in req.messages:
        # "developer" is OpenAI's newer name for "system"; chat templates know only the latter
        message: Dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _chat_text(m.content)}
        if m.tool_calls:
            message["tool_calls"] = template_messages_tool_calls([c.model_dump() for c in m.tool_calls])
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _chat_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise unsupported("messages", "Only text content parts are supported.")
        texts.append(part.text)
    return "".join(texts)


def _check_stop(stop: Union[str, List[str], None]) -> None:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"Invalid value for 'stop': give at most {MAX_STOP} stop strings of at most "
                          f"{MAX_STOP_CHARS} characters each.", "stop")


def _sampling_params(req: _Sampling, max_tokens: Optional[int], logprobs: Optional[int],
                     rename: Dict[str, str], guide: Optional[StructuredOutputsParams] = None) -> SamplingParams:
    _check_stop(req.stop)
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"Invalid value for 'n': it must be an integer from 1 to {MAX_N}.", "n")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        p = rename.get("logprobs", "logprobs")
        raise bad_request(f"Invalid value for '{p}': it must be an integer from 0 to {MAX_LOGPROBS}.", p)
    structured = _structured_outputs(req)
    if guide is not None:          # a forced tool call
        if structured is not None:
            raise bad_request("A forced tool call ('tool_choice' 'required' or a function) cannot be combined "
                              "with another structured output constraint.", "tool_choice")
        structured = guide
    logit_bias = _logit_bias(req.logit_bias)
    if req.temperature is not None and not 0 <= req.temperature <= 2:   # OpenAI's range (NaN fails too)
        raise bad_request(f"Invalid value for 'temperature': it must be {_RANGES['temperature']}.", "temperature")
    # a null field takes SamplingParams' default
    optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty)
    try:
        return SamplingParams(
            n=req.n, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            max_thinking_tokens=req.max_thinking_tokens, logit_bias=logit_bias, structured_outputs=structured,
            **{k: v for k, v in optional.items() if v is not None})
    except ValueError as e:
        raise sampling_error(e, rename) from None


MAX_GUIDE_CHARS = 64 * 1024     # a schema, regex or grammar in a request (as JSON text)


def _logit_bias(bias: Optional[Dict[str, Any]]) -> Optional[Dict[int, float]]:
    """OpenAI's {"token id": bias}: decimal ids, at most MAX_LOGIT_BIAS, biases in [-100, 100] (the ids
    are checked against the vocabulary with the other parameters, in encode_prompts)."""
    if not bias:
        return None
    valid = _RANGES["logit_bias"]
    if len(bias) > MAX_LOGIT_BIAS or not all(k.isascii() and k.isdigit() and len(k) < 10 for k in bias) \
            or not all(-100 <= v <= 100 for v in bias.values()):
        raise bad_request(f"Invalid value for 'logit_bias': it must be {valid}.", "logit_bias")
    return {int(k): float(v) for k, v in bias.items()}


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_outputs(req: _Sampling) -> Optional[StructuredOutputsParams]:
    """response_format / structured_outputs / guided_* -> StructuredOutputsParams (at most one of them);
    a 400 naming the field when it is malformed or does not compile (the message never quotes it)."""
    given = []
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        given.append(("response_format", _response_format(rf)))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for field, kind in _GUIDED.items():
        if getattr(req, field) is not None:
            given.append((field, {kind: getattr(req, field)}))
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"Give only one of 'response_format', 'structured_outputs' and the 'guided_*' fields "
                          f"(got '{given[0][0]}' and '{given[1][0]}').", given[1][0])
    param, spec = given[0]
    if len(_json_text(spec)) > MAX_GUIDE_CHARS:      # bound the text before compiling it
        raise bad_request(f"Invalid value for '{param}': at most {MAX_GUIDE_CHARS} characters.", param)
    try:
        so = StructuredOutputsParams(**spec)
        so.source_param = param          # the field later errors (compiling for the vocabulary) name
        return so
    except (ValueError, TypeError):
        raise bad_request(f"Invalid value for '{param}': it could not be compiled into a grammar (give a valid "
                          f"JSON schema, regex, list of choices or Lark/GBNF grammar, within the size limits).",
                          param) from None


def _json_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return ""


def _response_format(rf: Dict[str, Any]) -> Dict[str, Any]:
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format' of type 'json_schema' needs 'json_schema': {'name', 'schema'}.",
                              "response_format")
        return {"json": schema}
    raise bad_request("Invalid value for 'response_format': 'type' must be 'text', 'json_object' or "
                      "'json_schema'.", "response_format")


# ---------------------------------------------------------------------------------------------------
# Prompts -> token ids (needs the engine)

def encode_prompts(engine, req: GenerationRequest) -> List[List[int]]:
    """The token ids of each prompt (chat: of the rendered conversation), checked against the
    vocabulary and the context; APIError otherwise. The model's sampling defaults (engine.sampling_defaults) fill
    the fields the body left out. Slow for long inputs: run it off an event loop."""
    if getattr(engine, "is_encoder", False):
        raise bad_request("This is an embedding model (an encoder): it embeds and scores text and does not "
                          "generate; use /v1/embeddings, /v1/score or /v1/rerank.", "model")
    defaults = {k: v for k, v in (getattr(engine, "sampling_defaults", None) or {}).items() if k in req.unset}
    if defaults:
        try:
            req.params = dataclasses.replace(req.params, **defaults)
        except ValueError as e:          # the model's temperature 0 with n > 1
            raise sampling_error(e) from None
    if req.chat:
        prompts = [encode_chat(engine, req.messages, req.template_kwargs)]
        req.reasoning = _reasoning_state(engine, prompts[0])
    elif req.suffix is not None:
        fim = fim_tokens(engine.tokenizer, engine.vocab_size)
        if fim is None:
            raise unsupported("suffix", "'suffix' is not supported: this model has no fill-in-the-middle tokens.")
        prompts = [fim_prompt(engine.tokenizer, fim, p, req.suffix) for p in req.prompts]
    else:
        prompts = []
        for p in req.prompts:
            if not isinstance(p, str) and any(not 0 <= t < engine.vocab_size for t in p):
                raise bad_request("The prompt contains token ids outside the vocabulary.", "prompt")
            prompts.append(engine.encode_prompt(p))
    for ids in prompts:
        check_context(ids, engine.max_seq_len, req.prompt_param, req.params.max_tokens, req.max_tokens_param)
        try:
            engine.check_prompt(ids)     # and the KV cache, which a context-sized prompt may outgrow
        except ValueError:
            raise bad_request("The prompt needs more KV-cache blocks than the server has.", req.prompt_param,
                              code="context_length_exceeded") from None
    try:
        req.params.validate_against_vocab(engine.vocab_size)
    except ValueError as e:
        raise sampling_error(e) from None
    if req.params.structured_outputs is not None:
        _compile_for(engine, req.params.structured_outputs)
    req.prompt_ids = prompts
    return prompts


def _reasoning_state(engine, ids: List[int]) -> Optional[bool]:
    """None when the model's chat template writes no thoughts; else whether the prompt left one open."""
    tok = engine.tokenizer
    if not template_thinks(getattr(tok, "chat_template", None)):
        return None
    return prompt_opens_thought(tok.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))


def _compile_for(engine, so: StructuredOutputsParams) -> None:
    """Compiles the grammar for the engine's tokenizer here (off the event loop; the engine's sequences
    then copy the cached matcher); a 400 when it does not compile for this vocabulary."""
    try:
        GuidedMatcher(so, engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    except UnsatisfiableConstraint:
        raise bad_request("The structured output constraint can never be satisfied: no output matches it.",
                          getattr(so, "source_param", "structured_outputs"), code="unsatisfiable_constraint") from None
    except ValueError:
        raise bad_request("The structured output constraint could not be compiled for this model's "
                          "vocabulary.", getattr(so, "source_param", "structured_outputs")) from None


def encode_chat(engine, messages: List[Dict[str, Any]], template_kwargs: Optional[Dict[str, Any]] = None,
                add_generation_prompt: bool = True, param: str = "messages",
                add_special_tokens: bool = False) -> List[int]:
    """Token ids of a conversation through the model's chat template (which writes BOS itself), with
    extra template variables; a 400 naming `param` when the template cannot be applied."""
    try:
        if not template_kwargs and not add_special_tokens:
            return engine.encode_chat(messages, add_generation_prompt=add_generation_prompt)
        tok = engine.tokenizer
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        return tok.encode(text, add_special_tokens=add_special_tokens)
    except ValueError:
        raise bad_request("The chat template could not be applied to these messages.", param) from None


# Fill-in-the-middle: the spellings of (prefix, suffix, middle) tokens, Qwen2.5-Coder's, then
# StarCoder's / SmolLM's / DeepSeek-Coder-like ones.
FIM_SPELLINGS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                 ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]


def fim_tokens(tokenizer, vocab_size: int) -> Optional[List[int]]:
    """The ids of the model's (prefix, suffix, middle) FIM tokens, or None when it has none."""
    for names in FIM_SPELLINGS:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None and 0 <= i < vocab_size for i in ids):
            return ids
    return None


def fim_prompt(tokenizer, fim: List[int], prefix: str, suffix: str) -> List[int]:
    """Prefix-suffix-middle order: [the tokenizer's leading special tokens (BOS, if it adds one)]
    <prefix> prefix <suffix> suffix <middle>; the model writes the middle."""
    head = tokenizer.encode("", add_special_tokens=True)
    pre, suf, mid = fim
    return (head + [pre] + tokenizer.encode(prefix, add_special_tokens=False) + [suf]
            + tokenizer.encode(suffix, add_special_tokens=False) + [mid])


# A token spells at most as many bytes of text as its vocabulary entry has in UTF-8 (byte-level
# entries use one character per byte, SentencePiece's "\u2581" stands for a space, byte-fallback entries
# read "<0x41>"); Unicode normalization (NFC, NFKC) composes at most 3 input bytes into 1 (Hangul jamo).
NORMALIZATION_SLACK = 3


def prompt_byte_limit(engine) -> Optional[int]:
    """The most bytes of prompt text that can fit the engine's context: max_seq_len tokens times the
    most bytes one token can stand for (its longest vocabulary entry, times NORMALIZATION_SLACK). A
    longer text needs more tokens than the context holds, so it is refused without tokenizing it.
    None when the tokenizer cannot tell."""
    tok = getattr(engine, "tokenizer", None)
    try:
        longest = max(len(t.encode("utf-8", "surrogatepass"))
                      for t in map(tok.id_to_token, range(int(engine.vocab_size))) if t)
    except (AttributeError, TypeError, ValueError):
        return None
    return int(engine.max_seq_len) * max(longest, 1) * NORMALIZATION_SLACK


def _text_bytes(text: Optional[str]) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if isinstance(text, str) else 0


def check_prompt_bytes(req: GenerationRequest, limit: Optional[int], max_seq_len: int) -> None:
    """A 400 context_length_exceeded when a prompt's text (a chat's message contents) is more than
    `limit` bytes (prompt_byte_limit): cheap, before the template renders it and the tokenizer reads it."""
    if limit is None:
        return
    if req.chat:
        sizes = [sum(_text_bytes(m.get("content")) for m in req.messages or ())]
    else:
        sizes = [_text_bytes(p) + _text_bytes(req.suffix) for p in req.prompts]
    if max(sizes, default=0) > limit:
        raise bad_request(f"This model's maximum context length is {max_seq_len} tokens, and the "
                          f"{req.prompt_param} has {max(sizes)} bytes of text, more than that many tokens can "
                          f"hold ({limit} bytes at most).", req.prompt_param, code="context_length_exceeded")


def check_context(ids: List[int], limit: int, param: str, max_tokens: Optional[int] = None,
                  max_tokens_param: str = "max_tokens") -> None:
    """The prompt leaves room in the context for at least one token, and for max_tokens when it is
    given: more is a 400, as vLLM's server answers (corelm.LLM, like vLLM's offline LLM, stops at the
    context instead, with finish_reason "length")."""
    if not ids:
        raise bad_request(f"The '{param}' is empty.", param)
    if len(ids) >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt has "
                          f"{len(ids)} tokens (at least one token must be left to generate).",
                          param, code="context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(ids) + max_tokens} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                          f"completion). Please reduce the length of the {param} or completion.",
                          max_tokens_param, code="context_length_exceeded")
