"""The OpenAI API's vocabulary, shared by `corelm serve` and `corelm batch` so both accept the same
fields with the same defaults, limits and error messages, and answer in the same shapes.

    req = parse_request(CHAT_URL, body)             # -> GenerationRequest (prompts, SamplingParams); APIError
    prompts = encode_prompts(engine, req)           # token ids, checked against the model; APIError
    response = Response(req, prompt_tokens, served_model_name(path), TokenText(engine.tokenizer))
    response.add(prompt_index, chunk) ...; response.body()

Each front end keeps its own error envelope: the server answers APIError.status with
{"error": {...}}, a batch file writes an error line {"code", "message"}.
"""
from ..engine import served_model_name  # noqa: F401  (the model's id in /v1/models and every response)
from .protocol import (CHAT_URL, COMPLETIONS_URL, MAX_LOGPROBS, MAX_N, APIError, GenerationRequest,  # noqa: F401
                       bad_request, encode_prompts, parse_request, sampling_error)
from .responses import Response, TokenText  # noqa: F401
