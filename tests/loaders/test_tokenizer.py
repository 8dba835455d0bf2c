"""Tokenizer: HF folder vs GGUF-built parity, known ids, special tokens, and error handling."""
import json
import os
import shutil
import unicodedata

import numpy as np
import pytest

from corelm.loader.gguf import read_gguf
from corelm.loader.spec import ModelLoadError
from corelm.tokenizer import Tokenizer

from conftest import FIXTURES, MODELS, real_model

STORIES_DIR = os.path.join(MODELS, "stories260K")
SMOLLM2_HF_DIR = os.path.join(MODELS, "smollm2-hf-meta")     # committed tokenizer files of SmolLM2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"             # real models: names for conftest.real_model
QWEN2_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"

# Strings that stress pre-tokenization, byte fallback and special-token matching.
TRICKY = [
    "", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "a", "Hello world", " Hello", "Hello ", "  Hello  world  ",
    "Hello,world!", "don't won't I'm you're we've they'll he'd", "DON'T", "a\nb\r\nc", "line one\n\nline two\n",
    "0", "123", "12345 67890", "3.14159", "1,000,000", "x=1+2*3", "Café déjà vu, naïve façade, Ångström",
    "Zürich Straße", "日本語のテキスト", "中文字符串测试", "한국어", "😀", "😀😃😄 emoji 👍🏽 family 👨‍👩‍👧",
    "Ελληνικά и кириллица", "عربى", "<s>", "</s>", "<unk>", "x<s>y", "Hello <s> world </s>", "<s><s>",
    "tab\tseparated\tvalues", "    indented code():\n        return 1", "\u00a0non-breaking\u2009thin",
    "zero\u200bwidth", "Once upon a time, there was a little girl named Lily. " * 20,
]


def gguf_tokenizer(path):
    return Tokenizer.from_gguf_metadata(read_gguf(path).metadata)


@pytest.fixture(scope="module")
def stories_hf():
    return Tokenizer.from_hf_folder(STORIES_DIR)


@pytest.fixture(scope="module")
def stories_gguf():
    return gguf_tokenizer(os.path.join(STORIES_DIR, "stories260K.gguf"))


@pytest.fixture(scope="module")
def smollm2():
    return gguf_tokenizer(real_model(SMOLLM2_GGUF))


# ---------------------------------------------------------------------------------------------
# stories260K: SentencePiece vocabulary rebuilt from GGUF == the HF tokenizer.json of the same model

def test_tricky_list_is_big_enough():
    assert len(TRICKY) >= 40


@pytest.mark.parametrize("text", TRICKY)
def test_stories_gguf_encodes_like_hf(stories_hf, stories_gguf, text):
    for add_special in (True, False):
        assert stories_gguf.encode(text, add_special) == stories_hf.encode(text, add_special)
    ids = stories_hf.encode(text)
    for skip in (True, False):
        assert stories_gguf.decode(ids, skip) == stories_hf.decode(ids, skip)


def test_stories_attributes(stories_hf, stories_gguf):
    for tok in (stories_hf, stories_gguf):
        assert tok.vocab_size == 512
        assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
        assert tok.eos_token_ids == [2]
        assert tok.add_bos_token is True
        assert tok.chat_template is None
        assert [tok.is_special(i) for i in range(4)] == [True, True, True, False]
        assert tok.encode("") == [1] and tok.encode("", add_special_tokens=False) == []
        assert tok.encode("Hello")[0] == 1
        assert tok.decode(tok.encode("Hello world")) == "Hello world"


# ---------------------------------------------------------------------------------------------
# SmolLM2 (byte-level BPE, pre-tokenizer "smollm")

# Ids produced by transformers' AutoTokenizer for HuggingFaceTB/SmolLM2-135M-Instruct.
SMOLLM2_KNOWN = {
    "Hello, we can use": [19556, 28, 392, 416, 722],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face":
        [2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182],
    "\n": [198],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
}


@pytest.mark.parametrize("text", list(SMOLLM2_KNOWN))
def test_smollm2_known_ids(smollm2, text):
    assert smollm2.encode(text) == SMOLLM2_KNOWN[text]     # no BOS: add_bos_token is false


def test_smollm2_attributes(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.add_bos_token is False
    assert smollm2.bos_token == "<|im_start|>" and smollm2.eos_token == "<|im_end|>"
    assert smollm2.eos_token_ids == [2, 0]                 # <|im_end|>, then <|endoftext|>
    assert smollm2.chat_template and "<|im_start|>" in smollm2.chat_template
    assert smollm2.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert smollm2.is_special(1) and not smollm2.is_special(4093)


@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_roundtrip(smollm2, text):
    assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


def test_qwen2_gguf():
    tok = gguf_tokenizer(real_model(QWEN2_GGUF))
    assert tok.add_bos_token is False
    assert tok.eos_token_ids[:2] == [151645, 151643]        # <|im_end|>, <|endoftext|>
    assert tok.encode("Hello") == [9707]
    assert tok.encode("\n\n") == [271]
    # <tool_call> is user-defined: matched as one token, but kept when special tokens are skipped.
    ids = tok.encode("<tool_call><|im_end|>")
    assert ids == [151657, 151645]
    assert tok.decode(ids) == "<tool_call>"
    for text in TRICKY:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


# ---------------------------------------------------------------------------------------------
# HF folder details

@pytest.fixture
def hf_copy(tmp_path):
    """A writable copy of the stories260K tokenizer files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(STORIES_DIR, name), tmp_path / name)
    return tmp_path


def _edit_json(path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def test_hf_add_bos_token_false_in_config_removes_bos(hf_copy):
    _edit_json(hf_copy / "tokenizer_config.json", lambda c: c.update(add_bos_token=False))
    tok = Tokenizer.from_hf_folder(str(hf_copy))
    assert tok.add_bos_token is False
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)


def test_hf_special_tokens_as_dicts_and_special_tokens_map(hf_copy):
    def edit(c):
        c["bos_token"] = {"content": "<s>", "lstrip": False}
        del c["eos_token"]
    _edit_json(hf_copy / "tokenizer_config.json", edit)
    (hf_copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = Tokenizer.from_hf_folder(str(hf_copy))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_hf_chat_template_forms(hf_copy):
    cfg = hf_copy / "tokenizer_config.json"
    _edit_json(cfg, lambda c: c.update(chat_template="A{{ messages[0]['content'] }}"))
    assert Tokenizer.from_hf_folder(str(hf_copy)).chat_template == "A{{ messages[0]['content'] }}"

    _edit_json(cfg, lambda c: c.update(chat_template=[{"name": "default", "template": "D"},
                                                      {"name": "tool_use", "template": "T"}]))
    tok = Tokenizer.from_hf_folder(str(hf_copy))
    assert tok.chat_template == "D"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="tool_use") == "T"

    (hf_copy / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_folder(str(hf_copy)).chat_template == "J"


def test_hf_truncation_and_padding_in_file_are_ignored(hf_copy):
    def edit(t):
        t["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
        t["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                        "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"}
    _edit_json(hf_copy / "tokenizer.json", edit)
    tok = Tokenizer.from_hf_folder(str(hf_copy))
    assert tok.encode("Once upon a time there was") == Tokenizer.from_hf_folder(STORIES_DIR).encode(
        "Once upon a time there was")


def test_gguf_named_chat_templates(stories_meta):
    meta = dict(stories_meta, **{"tokenizer.chat_template": "D", "tokenizer.chat_template.tool_use": "T"})
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template == "D" and tok.named_chat_templates == {"tool_use": "T"}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="tool_use") == "T"


def test_hf_end_of_turn_tokens_join_eos(hf_copy):
    def edit(t):
        t["added_tokens"].append({"id": 512, "content": "<|im_end|>", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    _edit_json(hf_copy / "tokenizer.json", edit)
    tok = Tokenizer.from_hf_folder(str(hf_copy))
    assert tok.vocab_size == 513
    assert tok.eos_token_ids == [2, 512]
    assert tok.encode("a<|im_end|>", add_special_tokens=False)[-1] == 512


def test_decode_accepts_numpy_and_rejects_negative(stories_hf):
    ids = np.array(stories_hf.encode("Hello world"), dtype=np.int64)
    assert stories_hf.decode(ids) == "Hello world"
    with pytest.raises(ValueError, match="non-negative"):
        stories_hf.decode([1, -5])
    with pytest.raises(TypeError):
        stories_hf.encode(b"bytes")


# ---------------------------------------------------------------------------------------------
# Errors: missing and corrupt tokenizer files

@pytest.mark.parametrize("setup, message", [
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe{}"), "not valid UTF-8"),
    (lambda d: (d / "tokenizer.json").write_text("[1, 2]"), "not a tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}}'), "model.vocab"),
    (lambda d: _edit_json(d / "tokenizer.json", lambda t: t["model"]["vocab"].update({"x": -3})),
     "invalid token id"),
    (lambda d: _edit_json(d / "tokenizer.json", lambda t: t["added_tokens"].append(
        {"id": 99999, "content": "<x>", "special": True})), "out of range"),
    (lambda d: _edit_json(d / "tokenizer.json", lambda t: t.update(added_tokens=[{"id": "1"}])),
     "integer 'id'"),
    (lambda d: _edit_json(d / "tokenizer.json", lambda t: t["model"].update(type="NoSuchModel")),
     "tokenizers library rejected"),
    (lambda d: (d / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json is not valid JSON"),
    (lambda d: (d / "tokenizer_config.json").write_text("[]"), "must hold a JSON object"),
    (lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(bos_token="<nope>")),
     "not in the vocabulary"),
    (lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(bos_token=5)),
     "must be a string"),
    (lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(add_bos_token="yes")),
     "add_bos_token"),
    (lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template=[{"name": 1}])),
     "chat_template list"),
    (lambda d: _edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template=7)),
     "chat_template must be"),
])
def test_hf_folder_errors(hf_copy, setup, message):
    setup(hf_copy)
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_hf_folder(str(hf_copy))


@pytest.fixture(scope="module")
def stories_meta():
    return read_gguf(os.path.join(STORIES_DIR, "stories260K.gguf")).metadata


def _with(meta, **changes):
    m = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    for k, v in changes.items():
        key = "tokenizer.ggml." + k
        if v is None:
            m.pop(key, None)
        else:
            m[key] = v
    return m


@pytest.mark.parametrize("changes, message", [
    (dict(model=None), "no tokenizer"),
    (dict(model="t5"), "'t5' is not supported"),
    (dict(tokens=None), "tokens is missing"),
    (dict(tokens=[]), "tokens is missing or empty"),
    (dict(tokens=["a", 5]), r"tokens\[1\] must be a string"),
    (dict(tokens=[b"\xff"]), "invalid UTF-8"),
    (dict(scores=None), "needs scores"),
    (dict(scores=[0.0] * 3), "scores has 3 entries but there are 512 tokens"),
    (dict(scores=[float("nan")] * 512), "not a finite number"),
    (dict(token_type=[1] * 10), "token_type has 10 entries"),
    (dict(token_type=[9] * 512), "invalid token type 9"),
    (dict(bos_token_id=512), "bos_token_id = 512 is out of range"),
    (dict(eos_token_id=-7), "eos_token_id = -7 is out of range"),
    (dict(unknown_token_id="0"), "must be an integer"),
    (dict(add_bos_token="yes"), "add_bos_token must be a bool"),
])
def test_gguf_llama_vocab_errors(stories_meta, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_gguf_metadata(_with(stories_meta, **changes))


def _tiny_bpe_meta(**changes):
    tokens = ["h", "i", "hi", "Ġ", "Ġhi", "<|end|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3], "tokenizer.ggml.merges": ["h i", "Ġ hi"],
            "tokenizer.ggml.eos_token_id": 5, "tokenizer.ggml.bos_token_id": 0xFFFFFFFF}
    meta.update({"tokenizer.ggml." + k: v for k, v in changes.items()})
    return {k: v for k, v in meta.items() if v is not None}


def test_gguf_tiny_bpe_builds():
    tok = Tokenizer.from_gguf_metadata(_tiny_bpe_meta())
    assert tok.encode("hi hi<|end|>") == [2, 4, 5]
    assert tok.bos_token_id is None and tok.eos_token_ids == [5]
    assert tok.decode([2, 4, 5]) == "hi hi"
    assert tok.decode(np.array([2, 4, 5]), skip_special_tokens=False) == "hi hi<|end|>"


def _family_meta(pre):
    """A byte-level vocabulary whose tokenization differs between pre-tokenizer families."""
    tokens = ["1", "2", "12", "h", "e", "l", "o", "he", "hello", "Ã", "©", "Ã©", "Ì", "ģ"]
    return _tiny_bpe_meta(pre=pre, tokens=tokens, token_type=[1] * len(tokens),
                          merges=["1 2", "h e", "Ã ©"], eos_token_id=None)


@pytest.mark.parametrize("pre, digits, word, decomposed_e", [
    ("gpt2", ["12"], ["he", "l", "l", "o"], ["e", "Ì", "ģ"]),
    ("smollm", ["1", "2"], ["he", "l", "l", "o"], ["e", "Ì", "ģ"]),       # every digit alone
    ("llama-bpe", ["12"], ["hello"], ["e", "Ì", "ģ"]),                    # ignore_merges: whole words first
    ("qwen2", ["1", "2"], ["he", "l", "l", "o"], ["Ã©"]),                 # single digits, NFC first
])
def test_gguf_pre_tokenizer_families(pre, digits, word, decomposed_e):
    tok = Tokenizer.from_gguf_metadata(_family_meta(pre))
    pieces = lambda text: [tok.id_to_token(i) for i in tok.encode(text)]
    assert pieces("12") == digits
    assert pieces("hello") == word
    assert pieces("e\u0301") == decomposed_e
    assert tok.decode(tok.encode("12hello")) == "12hello"


@pytest.mark.parametrize("changes, message", [
    (dict(merges=None), "needs merges"),
    (dict(merges=["h i", "hx"]), "not of the form 'left right'"),
    (dict(merges=["h q"]), "not in the vocabulary"),
    (dict(merges=["Ġ h"]), "not in the vocabulary"),      # "Ġh" itself is missing
    (dict(merges=[7]), "not of the form"),
    (dict(pre="martian"), "pre-tokenizer 'martian' is not supported"),
])
def test_gguf_bpe_vocab_errors(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        Tokenizer.from_gguf_metadata(_tiny_bpe_meta(**changes))


def test_gguf_metadata_not_a_dict():
    with pytest.raises(ModelLoadError, match="must be a dict"):
        Tokenizer.from_gguf_metadata([1, 2])


def test_gguf_numpy_arrays_accepted(stories_meta, stories_gguf):
    m = _with(stories_meta, scores=np.asarray(stories_meta["tokenizer.ggml.scores"], dtype=np.float32),
              token_type=np.asarray(stories_meta["tokenizer.ggml.token_type"], dtype=np.int32),
              bos_token_id=np.uint32(1))
    tok = Tokenizer.from_gguf_metadata(m)
    assert tok.encode("Once upon a time") == stories_gguf.encode("Once upon a time")


# ---------------------------------------------------------------------------------------------
# transformers reference fixtures (tools/fixtures/make_fixtures.py): tokenizer_<name>.json

# Each tokenizer that can be built for a fixture: the committed ones always run (stories260K from its HF
# folder and GGUF, SmolLM2 from its committed HF tokenizer files); the GGUF sources come from real_model.
FIXTURE_SOURCES = {
    "stories260K-hf": ("stories260K", lambda: Tokenizer.from_hf_folder(STORIES_DIR)),
    "stories260K-gguf": ("stories260K", lambda: gguf_tokenizer(os.path.join(STORIES_DIR, "stories260K.gguf"))),
    "smollm2-hf": ("smollm2", lambda: Tokenizer.from_hf_folder(SMOLLM2_HF_DIR)),
    "smollm2-gguf": ("smollm2", lambda: gguf_tokenizer(real_model(SMOLLM2_GGUF))),
    "qwen2.5-coder-gguf": ("qwen2.5-coder", lambda: gguf_tokenizer(real_model(QWEN2_GGUF))),
}


def _load_fixture(name):
    with open(os.path.join(FIXTURES, f"tokenizer_{name}.json"), encoding="utf-8") as f:  # committed: never skip
        return json.load(f)


@pytest.mark.parametrize("source", list(FIXTURE_SOURCES))
def test_matches_transformers_fixture(source):
    name, build = FIXTURE_SOURCES[source]
    doc = _load_fixture(name)
    assert len(doc["cases"]) >= 40
    tok = build()
    assert (tok.bos_token_id, tok.eos_token_id) == (doc["bos_token_id"], doc["eos_token_id"])
    for case in doc["cases"]:
        text, where = case["text"], repr(case["text"])
        assert tok.encode(text) == case["ids_with_special"], where
        assert tok.encode(text, add_special_tokens=False) == case["ids"], where
        assert tok.decode(case["ids_with_special"], skip_special_tokens=False) == case["decoded_with_special"], where
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"], where
        assert tok.decode(case["ids_with_special"]) == case["decoded_skip_special"], where


def test_every_tokenizer_fixture_is_checked():
    """A committed tokenizer_<name>.json that no source above names would never be compared with anything."""
    names = {f[len("tokenizer_"):-len(".json")] for f in os.listdir(FIXTURES)
             if f.startswith("tokenizer_") and f.endswith(".json")}
    assert names == {name for name, _ in FIXTURE_SOURCES.values()}


# ---------------------------------------------------------------------------------------------
# llama.cpp's tokenizer test strings (tests/data/vocab: its models/ggml-vocab-*.gguf, vocabulary-only
# GGUFs, with the ids transformers gives each string, made by its convert_hf_to_gguf_update.py)

VOCAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "vocab")


@pytest.mark.parametrize("name", ["qwen2"])   # Qwen1.5-3's byte-level BPE (llama.cpp's pre "qwen2")
def test_llama_cpp_vocab_strings_match_transformers(name):
    from corelm.loader.gguf import read_gguf
    path = os.path.join(VOCAB, f"ggml-vocab-{name}.gguf")
    tok = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)
    texts = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    ids = open(path + ".out", encoding="utf-8").read().split("\n")
    assert len(texts) >= 40
    for text, want in zip(texts, ids):
        assert tok.encode(text, add_special_tokens=False) == [int(t) for t in want.split()], repr(text)
