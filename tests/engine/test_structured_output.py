"""Structured output (llguidance token masks) and logit_bias: the Python API, the OpenAI protocol
(server and batch share it) and the engine, on the embedded SmolLM2-135M-Instruct. Sampling at
temperature 0.8 with seeds, so it is the constraint, not the model, that makes each output valid."""
import json
import re
import time

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

import corelm
from corelm import SamplingParams
from corelm.engine.guided import GuidedDecodingParams, StructuredOutputsParams
from corelm.engine.sampling import Sampler
from corelm.openai.protocol import APIError, CHAT_URL, COMPLETIONS_URL, encode_prompts, parse_request

SECRET = "SECRET-do-not-echo"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array_bounds": {"type": "object",
                     "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                             "minItems": 2, "maxItems": 4}},
                     "required": ["tags"], "additionalProperties": False},
    "anyof": {"type": "object",
              "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                 {"type": "string", "enum": ["none", "many"]},
                                                 {"type": "boolean"}]}},
              "required": ["value"], "additionalProperties": False},
    "pattern": {"type": "object",
                "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                               "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
                "required": ["date", "code"], "additionalProperties": False},
    "numbers": {"type": "object",
                "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                               "score": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.25},
                               "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}},
                "required": ["age", "score", "delta"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": {"type": "object",
                                   "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                                  "ok": {"type": "boolean"}},
                                   "required": ["id", "ok"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def llm():
    return corelm.LLM()


def _generate(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params)]


# ---------------------------------------------------------------------------------------------------
# Every output parses and validates

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_and_greedy_outputs_validate_against_the_schema(llm, name):
    schema = SCHEMAS[name]
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=160, structured_outputs=so)
              for seed in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=160, structured_outputs=so))
    prompts = [f"Write a JSON object ({name}):"] * len(params)
    for out in _generate(llm, prompts, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_constrained_requests_batched_answer_as_alone(llm):
    """Constrained requests of different schemas in one batch (greedy ones taking the unmasked argmax
    where the grammar allows it) answer as each request alone."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMAS[n]))
              for n, t, s in zip(sorted(SCHEMAS), (0, 0.8, 0, 0.8, 0, 0.8, 0), range(7))]
    prompts = [f"Write a JSON object ({n}):" for n in sorted(SCHEMAS)][:len(params)]
    together = [o.text for o in _generate(llm, prompts, params)]
    assert together == [_generate(llm, [p], [q])[0].text for p, q in zip(prompts, params)]


def test_unconstrained_sampling_would_not_validate(llm):
    """The same prompts and seeds without the constraint: the model alone does not write valid JSON,
    so the test above measures the constraint."""
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=60) for seed in range(4)]
    outs = _generate(llm, ["Write a JSON object (numbers):"] * 4, params)
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.text), SCHEMAS["numbers"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid < 4


def test_json_object_regex_choice_and_grammar(llm):
    kinds = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
         lambda t: t in ("positive", "negative", "neutral")),
        # bounded repetition: a 135M model sampling an unbounded sum may add terms until max_tokens
        (StructuredOutputsParams(grammar='start: "(" num ("+" num)~0..3 ")"\nnum: /[1-9][0-9]?/'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", t)),
        (StructuredOutputsParams(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),   # GBNF
    ]
    for so, check in kinds:
        params = [SamplingParams(temperature=0.8, seed=s, max_tokens=80, structured_outputs=so) for s in range(3)]
        params.append(SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
        for out in _generate(llm, ["Answer:"] * len(params), params):
            assert out.finish_reason == "stop" and check(out.text), (so.kind, out.text)


def test_json_object(llm):
    """Any JSON object. A 135M model sampling at 0.8 may ramble inside a free-form object until
    max_tokens (finish_reason length, a valid prefix); every output that finished parses."""
    so = StructuredOutputsParams(json_object=True)
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=120, structured_outputs=so) for s in range(4)]
    params.append(SamplingParams(temperature=0, max_tokens=120, structured_outputs=so))
    msgs = [[{"role": "user", "content": "Describe a cat as a JSON object with name and age."}]] * len(params)
    outs = [o.outputs[0] for o in llm.chat(msgs, params)]
    assert sum(o.finish_reason == "stop" for o in outs) >= 3
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")


def test_a_finished_grammar_stops_the_sequence_without_eos(llm):
    """'yes' allows nothing but EOS afterwards: the sequence ends there, finish_reason stop, even with
    ignore_eos and a large max_tokens."""
    so = StructuredOutputsParams(choice=["yes"])
    out = _generate(llm, ["Say yes:"], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                                      structured_outputs=so))[0]
    assert out.text == "yes" and out.finish_reason == "stop"
    assert len(out.token_ids) <= 2


def test_guided_decoding_is_vllms_older_name(llm):
    so = GuidedDecodingParams(choice=["a", "b"])
    p = SamplingParams(temperature=0, max_tokens=5, guided_decoding=so)
    assert p.structured_outputs is so
    p2 = SamplingParams(temperature=0, max_tokens=5, structured_outputs={"choice": ["a", "b"]})
    assert p2.structured_outputs == so
    assert _generate(llm, ["x"], p)[0].text in ("a", "b")


def test_n_choices_and_seeds_are_reproducible(llm):
    so = StructuredOutputsParams(json=SCHEMAS["enum"])
    p = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=60, structured_outputs=so)
    a = [c.text for c in llm.generate(["Pick:"], p)[0].outputs]
    b = [c.text for c in llm.generate(["Pick:"], p)[0].outputs]
    assert a == b and len(a) == 3
    for t in a:
        jsonschema.validate(json.loads(t), SCHEMAS["enum"])


# ---------------------------------------------------------------------------------------------------
# Bad input: ValueError (API), bounded compile

@pytest.mark.parametrize("spec", [
    dict(json={"type": "no-such-type"}),
    dict(json={"type": "string", "format": "no-such-format"}),
    dict(json="{not json"),
    dict(json=[1, 2]),
    dict(regex="a(b"),
    dict(grammar="start: (("),
    dict(choice=[]),
    dict(choice="yes"),
    dict(),
    dict(regex="a", choice=["a"]),
    dict(json_object=True, regex="a"),
])
def test_invalid_constraints_are_value_errors(spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**spec)


def test_a_pathological_schema_is_an_error_not_a_stall():
    d = {"type": "string"}
    for _ in range(60):     # shared sub-dicts: 2^60 as text
        d = {"type": "object", "properties": {"a": d, "b": d}}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json=d)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        StructuredOutputsParams(regex="a" * 100_000)
    assert time.perf_counter() - t0 < 2.0


def test_hard_regex_still_generates_in_bounded_time(llm):
    so = StructuredOutputsParams(regex="(a|b)*a(a|b){12}")   # a 2^12-state DFA, built lazily under limits
    t0 = time.perf_counter()
    out = _generate(llm, ["x"], SamplingParams(temperature=0.8, seed=1, max_tokens=40, structured_outputs=so))[0]
    assert time.perf_counter() - t0 < 60
    assert re.fullmatch("[ab]*", out.text)


# ---------------------------------------------------------------------------------------------------
# logit_bias

def test_logit_bias_validation():
    assert SamplingParams(logit_bias={"5": 1, 7: -2.5}).logit_bias == {5: 1.0, 7: -2.5}
    for bad in ({5: 101}, {5: -100.5}, {-1: 1}, {"x": 1}, {5: float("nan")}, {i: 1 for i in range(301)}, [1]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1}).validate_against_vocab(100)


def test_logit_bias_is_added_before_sampling_and_before_the_mask():
    logits = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0, logit_bias={3: 10}), 4)
    assert s.sample(logits) == 3
    s = Sampler(SamplingParams(temperature=0, logit_bias={0: -100}), 4)
    assert s.sample(logits) == 1
    s = Sampler(SamplingParams(temperature=0, logit_bias={3: 100}), 4)
    assert s.sample(logits, allowed=np.array([False, True, True, False])) == 1   # the mask wins
    s = Sampler(SamplingParams(temperature=0.8, seed=3, logit_bias={2: 100}), 4)
    assert all(s.sample(logits) == 2 for _ in range(20))
    assert logits.tolist() == [3.0, 2.0, 1.0, 0.0]      # never modified


class _SetGrammar:
    """A grammar that allows a fixed set of ids, counting how often its mask is computed."""

    def __init__(self, allowed_ids, vocab):
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[list(allowed_ids)] = True
        self.masks = 0

    def allows(self, token):
        return bool(self.mask[token])

    def allowed(self):
        self.masks += 1
        return self.mask.copy()


@pytest.mark.parametrize("extra", [{}, {"logit_bias": {3: 2.5}}, {"repetition_penalty": 1.3},
                                   {"min_tokens": 2, "stop_token_ids": [5]}])
def test_lazy_grammar_gives_the_masked_greedy_choice(extra):
    """The sampler asks the grammar about the unmasked choice first and computes the mask only when the
    grammar refuses it; the token is the masked choice every time."""
    rng = np.random.default_rng(0)
    lazy_masks = 0
    for trial in range(200):
        vocab = int(rng.integers(2, 40))
        logits = rng.normal(size=vocab).astype(np.float32)
        logits[rng.integers(vocab)] = logits.max()            # ties: the first maximum wins in both
        ids = rng.choice(vocab, size=int(rng.integers(1, vocab + 1)), replace=False)
        bias = {k: v for k, v in extra.get("logit_bias", {}).items() if k < vocab}
        stops = [t for t in extra.get("stop_token_ids", []) if t < vocab]
        params = SamplingParams(temperature=0, **{**extra, "logit_bias": bias or None,
                                                   "stop_token_ids": stops or None})
        a, b = Sampler(params, vocab), Sampler(params, vocab)
        grammar = _SetGrammar(ids, vocab)
        history = rng.integers(vocab, size=3).tolist()
        a.start(history), b.start(history)
        assert a.sample(logits, grammar=grammar) == b.sample(logits, allowed=grammar.mask.copy()), trial
        lazy_masks += grammar.masks
    assert 0 < lazy_masks < 200          # some trials needed the mask, most did not


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, logit_bias={1: 1.0}),
                                    dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8)])
def test_lazy_grammar_samples_the_masked_distribution(params):
    """Sampling: the draw without the mask, kept only when allowed and otherwise redrawn under the mask,
    has the masked distribution (top_k / top_p take the mask first). Frequencies within 4.5 standard
    errors per token of the masked softmax computed here (a false alarm is ~1e-5 per token)."""
    x = np.array([2.0, 1.0, 0.5, 1.5, -0.5, 0.0], np.float32)
    ids = [1, 2, 4, 5]
    s = Sampler(SamplingParams(seed=3, **params), len(x))
    grammar = _SetGrammar(ids, len(x))
    draws = 20000
    got = np.bincount([s.sample(x, grammar=grammar) for _ in range(draws)], minlength=len(x)) / draws
    z = x.astype(np.float64) + np.array([params.get("logit_bias", {}).get(i, 0.0) for i in range(len(x))])
    z = np.where(grammar.mask, z / params["temperature"], -np.inf)
    order = np.argsort(-z)
    if "top_k" in params:
        z[order[params["top_k"]:]] = -np.inf
    p = np.exp(z - z.max())
    p /= p.sum()
    if "top_p" in params:
        keep = np.cumsum(p[order]) - p[order] < params["top_p"]
        p[order[~keep]] = 0
        p /= p.sum()
    tol = 4.5 * np.sqrt(p * (1 - p) / draws) + 1e-9
    assert np.all(np.abs(got - p) < tol), (got, p)
    assert got[[0, 3]].sum() == 0
    if "top_k" not in params and "top_p" not in params:
        # the mask is computed only for the draws the grammar refused: a share 1 - P(allowed)
        u = x.astype(np.float64) + np.array([params.get("logit_bias", {}).get(i, 0.0) for i in range(len(x))])
        u = np.exp(u / params["temperature"])
        refused = 1 - u[ids].sum() / u.sum()
        assert abs(grammar.masks / draws - refused) < 4.5 * np.sqrt(refused * (1 - refused) / draws)


def test_logit_bias_in_the_engine(llm):
    tok = llm.get_tokenizer().encode("!", add_special_tokens=False)[0]
    out = _generate(llm, ["Hello"], SamplingParams(temperature=0.8, seed=1, max_tokens=4,
                                                  logit_bias={tok: 100}))[0]
    assert out.token_ids == [tok] * 4
    out = _generate(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=8, logit_bias={tok: -100}))[0]
    assert tok not in out.token_ids


# ---------------------------------------------------------------------------------------------------
# The OpenAI protocol (server and batch)

def chat(**fields):
    return dict({"messages": [{"role": "user", "content": "Give JSON"}]}, **fields)


def test_protocol_maps_every_spelling_to_structured_outputs():
    schema = SCHEMAS["enum"]
    cases = [
        (CHAT_URL, chat(response_format={"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema, "strict": True}}), "json"),
        (CHAT_URL, chat(response_format={"type": "json_object"}), "json_object"),
        (COMPLETIONS_URL, {"prompt": "x", "guided_json": schema}, "json"),
        (COMPLETIONS_URL, {"prompt": "x", "guided_json": json.dumps(schema)}, "json"),
        (COMPLETIONS_URL, {"prompt": "x", "guided_regex": "[0-9]+"}, "regex"),
        (COMPLETIONS_URL, {"prompt": "x", "guided_choice": ["a", "b"]}, "choice"),
        (COMPLETIONS_URL, {"prompt": "x", "guided_grammar": 'start: "a"+'}, "grammar"),
        (CHAT_URL, chat(structured_outputs={"regex": "[a-z]+"}), "regex"),
    ]
    for url, body, kind in cases:
        so = parse_request(url, body).params.structured_outputs
        assert so is not None and so.kind == kind, body
    assert parse_request(CHAT_URL, chat(response_format={"type": "text"})).params.structured_outputs is None
    p = parse_request(COMPLETIONS_URL, {"prompt": "x", "logit_bias": {"5": 2, "10": -100}}).params
    assert p.logit_bias == {5: 2.0, 10: -100.0}


@pytest.mark.parametrize("url, body, param", [
    (CHAT_URL, chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                            "schema": {"type": SECRET}}}),
     "response_format"),
    (CHAT_URL, chat(response_format={"type": "json_schema"}), "response_format"),
    (CHAT_URL, chat(response_format={"type": SECRET}), "response_format"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_regex": SECRET + "(("}, "guided_regex"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_grammar": SECRET + ": (("}, "guided_grammar"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_choice": []}, "guided_choice"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_json": "{" + SECRET}, "guided_json"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_json": {"type": "object", "description": SECRET * 5000}}, "guided_json"),
    (COMPLETIONS_URL, {"prompt": "x", "structured_outputs": {SECRET: 1}}, "structured_outputs"),
    (COMPLETIONS_URL, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    (CHAT_URL, chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (COMPLETIONS_URL, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS_URL, {"prompt": "x", "logit_bias": {SECRET: 1}}, "logit_bias"),
    (COMPLETIONS_URL, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
])
def test_protocol_refusals_name_the_field_and_never_echo(url, body, param):
    with pytest.raises(APIError) as e:
        parse_request(url, json.dumps(body))
    assert e.value.status == 400 and e.value.param == param
    assert SECRET not in e.value.message and "((" not in e.value.message


def test_logit_bias_outside_the_vocabulary_is_a_400(llm):
    req = parse_request(COMPLETIONS_URL, {"prompt": "x", "logit_bias": {"999999": 1}})
    with pytest.raises(APIError) as e:
        encode_prompts(llm.engine, req)
    assert e.value.status == 400 and e.value.param == "logit_bias"


def test_protocol_request_runs_constrained(llm):
    schema = SCHEMAS["nested"]
    req = parse_request(CHAT_URL, chat(temperature=0.8, seed=3, max_tokens=120,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "p", "schema": schema}}))
    engine = llm.engine
    ids = encode_prompts(engine, req)[0]
    engine.add_request("so-1", ids, req.params)
    chunks = engine.run_to_completion()["so-1"]
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)


# ---------------------------------------------------------------------------------------------------
# corelm generate --json-schema FILE

def test_cli_generate_json_schema(tmp_path, capsys):
    from corelm.entrypoints import cli
    schema = SCHEMAS["nested"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    argv = ["generate", "-p", "A person as JSON:", "--json-schema", str(path), "--temp", "0.8", "-s", "2",
            "-n", "120", "--no-stream"]
    assert cli.main(argv) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), schema)


@pytest.mark.parametrize("content, message", [
    ("{oops", "is not valid JSON"),
    ('{"type": "no-such-type"}', "structured_outputs.json is invalid"),
    (None, "cannot read"),
])
def test_cli_bad_json_schema_exits_1(tmp_path, capsys, content, message):
    from corelm.entrypoints import cli
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    assert cli.main(["generate", "-p", "x", "--json-schema", str(path)]) == 1
    err = capsys.readouterr().err
    assert "--json-schema" in err and message in err and "Traceback" not in err
