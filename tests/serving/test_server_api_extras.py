"""The server's completions `echo` and `suffix` (fill-in-the-middle with the model's FIM tokens),
per-request `chat_template_kwargs`, and vLLM's /tokenize and /detokenize: answers, and 400s naming the
field (never echoing what the request sent)."""
import json
import os

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import corelm  # noqa: E402
from conftest import EMBEDDED_MODELS, MODELS  # noqa: E402
from corelm.openai.protocol import fim_prompt, fim_tokens  # noqa: E402
from test_server import KEY, SECRET, RecordingEngine, assert_error, engine_server, post  # noqa: E402

# A template that shows whether the request's chat_template_kwargs reached it.
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}no thinking\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
FIM = {"<fim_prefix>": 20, "<fim_suffix>": 21, "<fim_middle>": 22}   # stories260K has no FIM tokens


class FimTokenizer:
    """The model's tokenizer, with StarCoder-spelled FIM tokens at FIM's ids."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def token_to_id(self, token):
        return FIM.get(token, self.inner.token_to_id(token))


class FimEngine(RecordingEngine):
    def __init__(self, llm):
        super().__init__(llm)
        self.tokenizer = FimTokenizer(self.inner.tokenizer)


def stories():
    llm = corelm.LLM(os.path.join(MODELS, "stories260K"), dtype="fp32", threads=1, max_seq_len=256)
    llm.engine.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def served():
    return stories()


@pytest.fixture(scope="module")
def server(served):
    with engine_server(RecordingEngine, lambda: served, api_key=KEY, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def fim_server():
    llm = stories()
    with engine_server(FimEngine, lambda: llm) as s:
        yield s


def seen_prompt(s):
    return s.state.engine.seen[-1][0]


# --- echo ------------------------------------------------------------------------------------------

def test_echo_prefixes_the_prompt(server):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    echoed = post(server, "/v1/completions", dict(body, echo=True)).json()
    assert echoed["choices"][0]["text"] == "Once upon a time" + plain["text"]
    assert echoed["usage"] == post(server, "/v1/completions", body).json()["usage"]


def test_echo_token_id_prompts_and_n(server, served):
    ids = served.engine.encode_prompt("Once upon")
    r = post(server, "/v1/completions", {"prompt": [ids, ids], "max_tokens": 3, "n": 2, "temperature": 1, "seed": 3,
                                         "echo": True})
    assert r.status_code == 200, r.text
    text = served.engine.tokenizer.decode(ids)
    choices = r.json()["choices"]
    assert len(choices) == 4 and all(c["text"].startswith(text) and len(c["text"]) > len(text) for c in choices)


def test_echo_with_logprobs_lists_the_prompt_with_null_logprobs(server, served):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    lp = post(server, "/v1/completions", dict(body, echo=True)).json()["choices"][0]["logprobs"]
    n = len(served.engine.encode_prompt("Once upon a time"))
    assert lp["token_logprobs"][:n] == [None] * n and lp["top_logprobs"][:n] == [None] * n
    assert lp["token_logprobs"][n:] == plain["token_logprobs"]
    assert lp["tokens"][n:] == plain["tokens"]
    assert lp["text_offset"][n:] == [o + len("Once upon a time") for o in plain["text_offset"]]


def test_echo_streams_the_prompt_first(server):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "echo": True, "stream": True}
    texts = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    assert texts[0] == "Once upon a time"
    whole = post(server, "/v1/completions", dict(body, stream=False)).json()["choices"][0]["text"]
    assert "".join(texts) == whole


def test_echo_through_the_official_client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = c.completions.create(model="stories260K", prompt="Once", max_tokens=2, echo=True, temperature=0)
    assert out.choices[0].text.startswith("Once")


# --- suffix (fill in the middle) --------------------------------------------------------------------

def test_suffix_without_fim_tokens_is_a_400_naming_suffix(server):
    err = assert_error(post(server, "/v1/completions", {"prompt": "def f(", "suffix": SECRET}), 400, "suffix")
    assert "fill-in-the-middle" in err["message"]


def test_suffix_needs_text_prompts(server):
    assert_error(post(server, "/v1/completions", {"prompt": [1, 2], "suffix": "x"}), 400, "suffix")


def test_suffix_builds_prefix_suffix_middle(fim_server):
    r = post(fim_server, "/v1/completions", {"prompt": "Once upon", "suffix": "the end.", "max_tokens": 3}, key=None)
    assert r.status_code == 200, r.text
    tok = fim_server.state.engine.inner.tokenizer
    head = tok.encode("", add_special_tokens=True)
    assert seen_prompt(fim_server) == (head + [20] + tok.encode("Once upon", add_special_tokens=False) + [21]
                                       + tok.encode("the end.", add_special_tokens=False) + [22])
    assert r.json()["usage"]["prompt_tokens"] == len(seen_prompt(fim_server))


def test_fim_spellings():
    class Vocab:
        def __init__(self, names):
            self.ids = {n: i for i, n in enumerate(names)}

        def token_to_id(self, t):
            return self.ids.get(t)

        def encode(self, text, add_special_tokens=True):
            return ([99] if add_special_tokens else []) + ([100 + len(text)] if text else [])

    qwen = Vocab(["a", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"])
    assert fim_tokens(qwen, 10) == [1, 3, 2]
    assert fim_prompt(qwen, [1, 3, 2], "ab", "c") == [99, 1, 102, 3, 101, 2]
    assert fim_tokens(Vocab(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]), 10) == [0, 1, 2]
    assert fim_tokens(Vocab(["<fim_prefix>", "<fim_suffix>"]), 10) is None
    assert fim_tokens(Vocab(["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]), 2) is None   # outside the model


def test_embedded_smollm2_has_no_fim_tokens():
    """SmolLM2's vocabulary has no FIM tokens (SmolLM v1's <fim_*> spelling is absent), so suffix gets a 400."""
    llm = corelm.LLM(os.path.join(EMBEDDED_MODELS, "SmolLM2-135M-Instruct.Q4_1.gguf"), threads=1, max_seq_len=128)
    assert fim_tokens(llm.engine.tokenizer, llm.engine.vocab_size) is None


# --- chat_template_kwargs ---------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_chat_template_kwargs_reach_the_template(server, served):
    tok = served.engine.tokenizer
    r = post(server, "/v1/chat/completions", dict(CHAT, chat_template_kwargs={"enable_thinking": False}))
    assert r.status_code == 200, r.text
    assert seen_prompt(server) == tok.encode("user: Hi\nno thinking\nassistant:", add_special_tokens=False)
    r = post(server, "/v1/chat/completions", CHAT)
    assert seen_prompt(server) == tok.encode("user: Hi\nassistant:", add_special_tokens=False)


@pytest.mark.parametrize("kwargs", [{"messages": []}, {"add_generation_prompt": False}, {"bos_token": SECRET},
                                    {"not an identifier": 1}, {f"v{i}": 1 for i in range(33)}, {"_x": 1}])
def test_bad_chat_template_kwargs_get_400(server, kwargs):
    assert_error(post(server, "/v1/chat/completions", dict(CHAT, chat_template_kwargs=kwargs)), 400,
                 "chat_template_kwargs")


def test_chat_template_kwargs_must_be_an_object(server):
    assert_error(post(server, "/v1/chat/completions", dict(CHAT, chat_template_kwargs=[SECRET])), 400,
                 "chat_template_kwargs")


# --- /tokenize and /detokenize ----------------------------------------------------------------------

def test_tokenize_a_prompt(server, served):
    r = post(server, "/tokenize", {"prompt": "Once upon a time"})
    assert r.status_code == 200, r.text
    ids = served.engine.encode_prompt("Once upon a time")
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": 256}
    r = post(server, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False})
    assert r.json()["tokens"] == served.engine.tokenizer.encode("Once upon a time", add_special_tokens=False)


def test_tokenize_messages_with_template_kwargs(server, served):
    tok = served.engine.tokenizer
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                   "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode("user: Hi\nno thinking\nassistant:", add_special_tokens=False)
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False})
    assert r.json()["tokens"] == tok.encode("user: Hi\n", add_special_tokens=False)


def test_detokenize_round_trip(server, served):
    ids = post(server, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False}).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "Once upon a time"}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": SECRET}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": SECRET}},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": SECRET}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_token_requests_get_400(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_token_endpoints_share_auth_json_and_body_limits(server):
    for path in ("/tokenize", "/detokenize"):
        assert_error(post(server, path, {"prompt": "x", "tokens": [1]}, key=None), 401)
        assert_error(post(server, path, b"{not json"), 400)
        assert_error(post(server, path, {"prompt": "x" * 70_000, "tokens": [1] * 30_000}), 413)
        assert_error(post(server, path, [1, 2]), 400)



def test_real_model_fills_the_middle():
    """Qwen2.5-Coder-0.5B (a real GGUF, skipped without it) completes code between a prefix and a suffix
    through its own <|fim_*|> tokens, with the official client."""
    from conftest import real_model
    from test_server import running_server
    llm = corelm.LLM(real_model("qwen2.5-coder-0.5b-instruct.gguf"), max_seq_len=512)
    with running_server(lambda: llm, api_key=None) as s:
        assert s.state.wait_ready(120)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = c.completions.create(model="m", prompt="def area_of_rectangle(width, height):\n    return ",
                                 suffix="\n\n\nprint(area_of_rectangle(3, 4))\n", temperature=0, max_tokens=16)
        text = r.choices[0].text
        assert "width * height" in text.replace("(", "").replace(")", "") or "height * width" in text, text
        assert "print(" not in text, text            # the middle, not the suffix again
