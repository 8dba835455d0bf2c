#!/usr/bin/env python3
"""Seeded mutation fuzzing of corelm's loaders and chat-template renderer.

    python tools/fuzz/fuzz.py --target gguf --seconds 600 --seed 1      # one target, a long run
    python tools/fuzz/fuzz.py --target all --seconds 30 --seed 1        # every target, 30 s each
    python tools/fuzz/fuzz.py --make-seeds                              # (re)writes tests/data/fuzz/

Targets and what one input is:
    gguf      a .gguf file                      load_model, every weight (float and raw blocks), RoPE, tokenizer
    hf        an HF folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)   as gguf
    corelm    a corelm folder (`corelm convert`'s config.json + weights.corelm + tokenizer files)      as gguf
    template  a JSON {"template", "messages", "kwargs"}   corelm.tokenizer.chat_template.render_chat_template
    template_depth  as template, mutated towards deep values (nested tuples, lists, dicts, namespaces,
              macros' varargs), recursive macros and huge loops: no crash (a deep tuple's hash() overflows
              the C stack) and no hang
    server    a hostile HTTP client against a running `corelm serve` (fuzz_server.py; not part of "all")

Each input starts from a seed in tests/data/fuzz/<target>/ (small files made from the committed test
model and corrupt corpus by --make-seeds), gets 1-4 stacked mutations (byte flips, interesting integers,
splices, truncation, and structural JSON edits), and runs in a worker subprocess under a per-input
deadline and a 4 GiB address-space cap. Outcomes: ok (loaded), refused (ModelLoadError; for templates
ChatTemplateError), and the failures: crash (the worker died), hang (missed the deadline; the worker is
killed and restarted) and foreign (any other exception, BaseException included). Failing inputs are
saved under --failures (default fuzz-failures/<target>/) with a note of what happened. Exit status 1
when any failure was seen. Deterministic for a given --seed except where timing decides (hangs).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ_DIR = os.path.join(REPO, "tests", "data", "fuzz")
TARGETS = ("gguf", "hf", "corelm", "template", "template_depth")
TEMPLATE_TARGETS = ("template", "template_depth")
MEMORY_LIMIT = 4 << 30

INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 63, 64, 127, 128, 255, 256, 1023, 1024, 4095, 4096,
                    65535, 65536, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63,
                    (1 << 64) - 1, (1 << 64) - 32, -1, -2, -32]
INTERESTING_JSON = [None, True, False, 0, 1, -1, 2, 3, 7, 32, 1 << 31, 1 << 63, 10 ** 30, -(1 << 63), 0.0, -0.0,
                    1e-300, 1e308, float("nan"), float("inf"), float("-inf"), 0.5, "", "a", "<s>", "\u0000",
                    "x" * 300, [], [0], [None], {}, {"a": 1}, "llama3", "linear", "yarn", "dynamic", "default",
                    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "silu", "gelu"]
JINJA_SNIPPETS = [
    "{{ messages }}", "{% for m in messages %}", "{% endfor %}", "{% if x %}", "{% else %}", "{% endif %}",
    "{{ range(10 ** 9) | list }}", "{% for i in range(999999999) %}{{ i }}{% endfor %}", "{{ 'a' * 10 ** 9 }}",
    "{{ 9 ** 9 ** 9 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ loop.cycle }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "{{ ''.__class__.__mro__ }}",
    "{{ messages[0]['content'] | tojson }}", "{{ raise_exception('no') }}", "{% set x = namespace(a=1) %}",
    "{{ x.a }}", "{{ messages | length }}", "{{ bos_token }}", "{{ '%s' % messages }}", "{{ '{:>999999}'.format(1) }}",
    "{% include 'x' %}", "{% extends 'y' %}", "{% import 'z' as q %}", "{{ tools | tojson(indent=4) }}",
    "{{ (messages * 1000) | join }}", "{% filter upper %}", "{% endfilter %}", "{{ lipsum(9999) }}",
    "{{ cycler(1,2).next() }}", "{{ dict(a=1) | items | list }}", "{{ x | replace('', 'yy') }}", "{{", "}}",
    "{%", "%}", "{#", "#}", "\n", "{{ m.content.split('') }}", "{{ 'a'.center(10**8) }}", "{{ [1] * 10**8 }}",
]
# template_depth: what builds a deep value, and what then hashes, prints or compares it
DEPTH_WRAPS = ["({},)", "[{}]", "{{'k': {}}}", "dict(a={})", "namespace(p={})", "cycler({}).items",
               "dict(a={})|items|first", "dict(a={})|dictsort|first", "[dict(a={})]|groupby('a')|first",
               "[{}]|batch(1)|first", "({}, 1)", "[{}]|list", "({},)|unique|list"]
DEPTH_USES = ["{{ {ns.t: 1}|length }}", "{{ [ns.t, ns.t]|unique|list|length }}", "{{ ns.t in {ns.t: 1} }}",
              "{{ ns.t|tojson|length }}", "{{ ns.t|string|length }}", "{{ ns.t == ns.t }}", "{{ ns.t }}",
              "{{ [ns.t]|sort|length }}", "{{ (ns.t, 1)|dictsort }}", "{{ {(ns.t,): ns.t} }}"]
DEPTH_SNIPPETS = ["{% for i in range(300) %}", "{% for i in range(300000) %}", "{% endfor %}",
                  "{% set m = namespace() %}{% set m.p = ns %}{% set ns = m %}", "{% set ns.me = ns %}",
                  "{% macro f() %}{% set ns.t = varargs %}{% endmacro %}{{ f(ns.t) }}",
                  "{% macro g(n) %}{{ g(n + 1) }}{% endmacro %}{{ g(0) }}",
                  "{% macro h() %}{% set ns.t = kwargs %}{% endmacro %}{{ h(a=ns.t) }}",
                  "{% for m in messages recursive %}{{ loop([ns.t]) }}{% endfor %}",
                  "{% for i in range(10 ** 6) %}{% endfor %}", "{% set ns.t = ns.t + ns.t %}"]
DEPTH_NUMBERS = [0, 1, 2, 3, 60, 255, 256, 257, 300, 1000, 4000, 300000, 10 ** 6]


# ---------------------------------------------------------------------------------------------------
# Seeds.

def _corpus_tool():
    sys.path.insert(0, os.path.join(REPO, "tools", "fixtures"))
    import make_corrupt_corpus
    return make_corrupt_corpus


def make_seeds(out: str = FUZZ_DIR) -> Dict[str, List[str]]:
    """Writes the seed corpus: tiny models built from the corrupt-corpus tool (the same tiny Llama as
    tests/data/corrupt/valid_tiny_hf) and templates of the committed test models."""
    sys.path.insert(0, os.path.join(REPO, "python"))
    tool = _corpus_tool()
    made: Dict[str, List[str]] = {}
    for target in TARGETS:
        shutil.rmtree(os.path.join(out, target), ignore_errors=True)
        os.makedirs(os.path.join(out, target))

    def put(target: str, name: str, files: Dict[str, bytes]) -> None:
        base = os.path.join(out, target, name)
        if len(files) == 1 and name in files:
            base = os.path.join(out, target)
        os.makedirs(base, exist_ok=True)
        for fname, data in files.items():
            with open(os.path.join(base, fname), "wb") as f:
                f.write(data)
        made.setdefault(target, []).append(name)

    put("gguf", "tiny_llama_q.gguf", {"tiny_llama_q.gguf": tiny_gguf(tool, quant=True, vocab="llama")})
    put("gguf", "tiny_gpt2_f32.gguf", {"tiny_gpt2_f32.gguf": tiny_gguf(tool, quant=False, vocab="gpt2")})
    for c in tool.cases():      # well-formed GGUF files that are no model (load_model refuses them)
        if c.name.startswith("valid_") and c.name.endswith(".gguf"):
            put("gguf", "nomodel_" + c.name, {"nomodel_" + c.name: c.data})
    hf = tool.tiny_hf_folder()
    put("hf", "tiny_llama", hf)
    put("hf", "tiny_llama3_rope", next(c.files for c in tool.folder_cases() if c.name == "valid_tiny_hf_llama3_rope"))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        for fname, data in hf.items():
            with open(os.path.join(src, fname), "wb") as f:
                f.write(data)
        from corelm.convert import convert
        for weights in ("q8_0", "q4_0", "bf16"):
            d = convert(src, os.path.join(tmp, weights), weights=weights)
            files = {}
            for fname in sorted(os.listdir(d)):
                with open(os.path.join(d, fname), "rb") as f:
                    files[fname] = f.read()
            cfg = json.loads(files["config.json"])      # no absolute paths of this machine in the seeds
            cfg["source"]["path"], cfg["converted_by"] = "tiny_llama", "corelm"
            files["config.json"] = (json.dumps(cfg, indent=2) + "\n").encode()
            put("corelm", f"tiny_llama_{weights}", files)
    for i, (name, template) in enumerate(_model_templates(tool)):
        doc = {"template": template, "messages": _SEED_MESSAGES[i % len(_SEED_MESSAGES)],
               "kwargs": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
               if i % 2 else {}}
        put("template", f"{name}.json", {f"{name}.json": (json.dumps(doc, indent=1) + "\n").encode()})
    for name, doc in depth_seeds().items():
        put("template_depth", f"{name}.json", {f"{name}.json": (json.dumps(doc, indent=1) + "\n").encode()})
    return made


def depth_seeds() -> Dict[str, Dict[str, Any]]:
    """template_depth's seeds: each builds a nested value a few levels deep and uses it (all render; their
    mutants raise the counts and the nesting). refused_*: issue 50's reproducers, refused since."""
    msgs = _SEED_MESSAGES[0]
    loop = "{{% set ns = namespace(t={init}) %}}{{% for i in range({n}) %}}{{% set ns.t = {wrap} %}}{{% endfor %}}"
    templates = {
        "tuple_chain": loop.format(init="()", n=3, wrap="(" * 4 + "ns.t" + ",)" * 4) +
        "{{ {ns.t: 1}|length }} {{ [ns.t, ns.t]|unique|list|length }} {{ ns.t in {ns.t: 1} }}",
        "list_dict_chain": loop.format(init="[]", n=4, wrap="[ns.t, {'k': ns.t, 'm': messages[0]}]") +
        "{{ ns.t|tojson|length }} {{ ns.t|string|length }} {{ ns.t == ns.t }}",
        "filter_chain": loop.format(init="0", n=5, wrap="dict(a=ns.t)|items|first") +
        "{% set ns.t = dict(b=ns.t)|dictsort|first %}{{ {ns.t: 1}|length }}"
        "{% set ns.t = [dict(a=ns.t)]|groupby('a')|first %}{{ {ns.t|first: 1}|length }} {{ ns.t|string|length }}",
        "macro_varargs": "{% set ns = namespace(t=()) %}{% macro f() %}{% set ns.t = varargs %}{% endmacro %}"
        "{% for i in range(8) %}{{ f(ns.t) }}{% endfor %}{% macro r(n) %}{% if n > 0 %}{{ r(n - 1) }}{% endif %}"
        "{% endmacro %}{{ r(10) }}{{ {ns.t: 1}|length }}",
        "namespace_chain": "{% set ns = namespace(t=none) %}{% for i in range(10) %}{% set m = namespace(i=i) %}"
        "{% set m.p = ns.t %}{% set ns.t = m %}{% endfor %}{% set c = cycler(ns.t, (1,)) %}"
        "{{ c.next() is not none }} {{ ns.t.i }} {{ ns.t.p.p.i }}",
        "accumulate": "{% set ns = namespace(t=[]) %}{% for m in messages * 50 %}{% set ns.t = ns.t + [m] %}"
        "{% endfor %}{% for m in ns.t %}{{ m.role }}{% endfor %}",
        "refused_issue50_dict_key": loop.format(init="()", n=4000, wrap="(" * 60 + "ns.t" + ",)" * 60) +
        "{{ {ns.t: 1} }}",
        "refused_issue50_unique": loop.format(init="()", n=4000, wrap="(" * 60 + "ns.t" + ",)" * 60) +
        "{{ [ns.t, ns.t]|unique|list }}",
    }
    return {name: {"template": t, "messages": msgs, "kwargs": {}} for name, t in templates.items()}


_SEED_MESSAGES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
]


def _model_templates(tool) -> List[Tuple[str, str]]:
    from corelm.tokenizer.chat_template import CHATML_TEMPLATE
    out = [("chatml", CHATML_TEMPLATE), ("tiny", tool.TINY_CHAT_TEMPLATE)]
    models = os.path.join(REPO, "tests", "data", "models")
    for m in sorted(os.listdir(models)):
        jinja = os.path.join(models, m, "chat_template.jinja")
        cfg = os.path.join(models, m, "tokenizer_config.json")
        if os.path.isfile(jinja):
            out.append((m, open(jinja, encoding="utf-8").read()))
        elif os.path.isfile(cfg):
            t = json.load(open(cfg, encoding="utf-8")).get("chat_template")
            if isinstance(t, str):
                out.append((m, t))
    return out


def tiny_gguf(tool, quant: bool, vocab: str) -> bytes:
    """The corrupt-corpus tool's tiny Llama as a GGUF: quantized blocks (Q8_0 embedding, Q4_0/Q4_1/Q8_0
    matrices) or F32/F16/BF16, with a SentencePiece ("llama") or byte-level BPE ("gpt2") vocabulary."""
    import numpy as np
    arrays = tool.tiny_hf_arrays()
    t = tool.TINY
    meta = [("general.architecture", tool.STRING, "llama"),
            ("llama.context_length", tool.UINT32, 256), ("llama.embedding_length", tool.UINT32, t["dim"]),
            ("llama.block_count", tool.UINT32, t["layers"]), ("llama.feed_forward_length", tool.UINT32, t["ffn"]),
            ("llama.attention.head_count", tool.UINT32, t["heads"]),
            ("llama.attention.head_count_kv", tool.UINT32, t["kv_heads"]),
            ("llama.attention.key_length", tool.UINT32, t["head_dim"]),
            ("llama.rope.freq_base", tool.FLOAT32, 10000.0),
            ("llama.attention.layer_norm_rms_epsilon", tool.FLOAT32, 1e-5),
            ("tokenizer.ggml.bos_token_id", tool.UINT32, 1), ("tokenizer.ggml.eos_token_id", tool.UINT32, 2),
            ("tokenizer.chat_template", tool.STRING, tool.TINY_CHAT_TEMPLATE)]
    if vocab == "llama":
        tokens = ["<unk>", "<s>", "</s>", "\u2581hello", "\u2581world", ",", "!", "a"]
        meta += [("tokenizer.ggml.model", tool.STRING, "llama"),
                 ("tokenizer.ggml.tokens", tool.ARRAY, (tool.STRING, tokens)),
                 ("tokenizer.ggml.scores", tool.ARRAY, (tool.FLOAT32, [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0])),
                 ("tokenizer.ggml.token_type", tool.ARRAY, (tool.INT32, [2, 3, 3, 1, 1, 1, 1, 1]))]
    else:
        tokens = ["<|endoftext|>", "<s>", "</s>", "h", "e", "l", "he", "hel"]
        meta += [("tokenizer.ggml.model", tool.STRING, "gpt2"), ("tokenizer.ggml.pre", tool.STRING, "default"),
                 ("tokenizer.ggml.tokens", tool.ARRAY, (tool.STRING, tokens)),
                 ("tokenizer.ggml.merges", tool.ARRAY, (tool.STRING, ["h e", "he l"])),
                 ("tokenizer.ggml.token_type", tool.ARRAY, (tool.INT32, [3, 3, 3, 1, 1, 1, 1, 1]))]
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    tensors = []
    for i, (hf, w) in enumerate(arrays.items()):
        if hf in names:
            name = names[hf]
        else:
            layer, rest = hf[len("model.layers."):].split(".", 1)
            name = f"blk.{layer}.{per_layer[rest.rsplit('.', 1)[0]]}.weight"
        ne = list(reversed(w.shape))
        if w.ndim == 1:
            tensors.append((name, ne, tool.F32, tool.f32_bytes(w)))
        elif quant:
            kind = (tool.Q8_0, tool.Q4_0, tool.Q4_1)[i % 3] if name != "token_embd.weight" else tool.Q8_0
            blocks = w.reshape(-1, 32)
            amax = np.abs(blocks).max(1)
            if kind == tool.Q8_0:
                d = amax / 127
                data = tool.q8_0_bytes(d, np.round(blocks / np.where(d, d, 1)[:, None]))
            elif kind == tool.Q4_0:
                d = amax / 8
                data = tool.q4_0_bytes(d, np.clip(np.round(blocks / np.where(d, d, 1)[:, None]) + 8, 0, 15))
            else:
                mn = blocks.min(1)
                d = (blocks.max(1) - mn) / 15
                data = tool.q4_1_bytes(d, mn, np.clip(np.round((blocks - mn[:, None]) / np.where(d, d, 1)[:, None]),
                                                      0, 15))
            tensors.append((name, ne, kind, data))
        else:
            kind = (tool.F32, tool.F16, tool.BF16)[i % 3]
            data = {tool.F32: tool.f32_bytes, tool.F16: tool.f16_bytes, tool.BF16: tool.bf16_bytes}[kind](w)
            tensors.append((name, ne, kind, data))
    return tool.build_gguf(meta, tensors)


def load_seeds(target: str, root: str = FUZZ_DIR) -> List[Tuple[str, Any]]:
    """(name, input) for each seed: bytes for file targets, {file name: bytes} for folder targets."""
    base = os.path.join(root, target)
    seeds = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if os.path.isdir(path):
            seeds.append((name, {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}))
        else:
            seeds.append((name, open(path, "rb").read()))
    if not seeds:
        raise SystemExit(f"no seeds in {base}; run: python tools/fuzz/fuzz.py --make-seeds")
    return seeds


# ---------------------------------------------------------------------------------------------------
# Mutation.

def mutate_bytes(data: bytes, rng: random.Random, other: Optional[bytes] = None) -> bytes:
    b = bytearray(data)
    op = rng.randrange(9)
    n = len(b)
    if n == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
    pos = rng.randrange(n)
    if op == 0:                                     # flip bits
        for _ in range(rng.randrange(1, 5)):
            p = rng.randrange(n)
            b[p] ^= 1 << rng.randrange(8)
    elif op == 1:                                   # interesting bytes
        for _ in range(rng.randrange(1, 5)):
            b[rng.randrange(n)] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x7B, 0x5B, rng.randrange(256)])
    elif op == 2:                                   # an interesting integer, little-endian, 1/2/4/8 bytes
        width = rng.choice([1, 2, 4, 8])
        v = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
        if rng.random() < 0.3:                      # near the value already there
            old = int.from_bytes(bytes(b[pos:pos + width]).ljust(width, b"\0"), "little")
            v = (old + rng.choice([-1, 1, -2, 2, 32, -32, 1 << 16])) % (1 << (8 * width))
        b[pos:pos + width] = v.to_bytes(width, "little")
    elif op == 3:                                   # truncate
        del b[rng.randrange(n):]
    elif op == 4:                                   # delete a span
        del b[pos:pos + rng.randrange(1, 65)]
    elif op == 5:                                   # insert bytes
        b[pos:pos] = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 33)))
    elif op == 6:                                   # duplicate a span
        span = bytes(b[pos:pos + rng.randrange(1, 129)])
        q = rng.randrange(n)
        b[q:q] = span
    elif op == 7 and other:                         # splice another seed in
        q = rng.randrange(len(other))
        b[pos:pos + rng.randrange(1, 257)] = other[q:q + rng.randrange(1, 257)]
    else:                                           # grow: append junk
        b += bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 129)))
    return bytes(b)


def _json_nodes(doc: Any, path=()) -> List[tuple]:
    out = [path]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _json_nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:64]):
            out += _json_nodes(v, path + (i,))
    return out


def mutate_json_value(doc: Any, rng: random.Random) -> Any:
    """One structural edit at a random node: replace it, delete it, or change its type."""
    paths = _json_nodes(doc)
    path = rng.choice(paths)
    if not path:
        return rng.choice(INTERESTING_JSON) if rng.random() < 0.1 else doc
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    r = rng.random()
    old = parent[key]
    if r < 0.2 and isinstance(parent, dict):
        del parent[key]
    elif r < 0.3 and isinstance(parent, list):
        parent.insert(key, old if rng.random() < 0.5 else rng.choice(INTERESTING_JSON))
    elif r < 0.45 and isinstance(old, (int, float)) and not isinstance(old, bool):
        parent[key] = rng.choice([old + 1, old - 1, old * 2, -old, old * 1000, old / 3, 0])
    elif r < 0.55 and isinstance(old, str) and old:
        parent[key] = rng.choice([old * rng.randrange(2, 50), old[:-1], old + "x", old.upper(), ""])
    elif r < 0.6 and isinstance(parent, dict):
        parent[rng.choice(["rope_scaling", "rope_type", "factor", "type", "special_tokens", "ids", "id",
                           "content", "post_processor", "head_dim", "weights", "spec"])] = rng.choice(INTERESTING_JSON)
    else:
        parent[key] = rng.choice(INTERESTING_JSON)
    return doc


def mutate_json_bytes(data: bytes, rng: random.Random) -> bytes:
    try:
        doc = json.loads(data)
    except ValueError:
        return mutate_bytes(data, rng)
    doc = mutate_json_value(doc, rng)
    return json.dumps(doc, indent=rng.choice([None, 1])).encode()


def mutate_folder(files: Dict[str, bytes], rng: random.Random, binary: str) -> Dict[str, bytes]:
    files = dict(files)
    r = rng.random()
    if r < 0.03 and files:
        del files[rng.choice(sorted(files))]
        return files
    names = sorted(files)
    weights = [6 if n == binary else 4 if n == "config.json" else 3 if n == "tokenizer.json" else 1 for n in names]
    name = rng.choices(names, weights)[0]
    if name.endswith(".json") and rng.random() < 0.75:
        files[name] = mutate_json_bytes(files[name], rng)
    else:
        files[name] = mutate_bytes(files[name], rng)
    return files


def mutate_template_doc(data: bytes, rng: random.Random) -> bytes:
    try:
        doc = json.loads(data)
        template, messages, kwargs = doc["template"], doc["messages"], doc.get("kwargs", {})
    except (ValueError, KeyError, TypeError):
        return data
    r = rng.random()
    if r < 0.45 and isinstance(template, str):
        pos = rng.randrange(len(template) + 1)
        op = rng.randrange(4)
        if op == 0:
            template = template[:pos] + rng.choice(JINJA_SNIPPETS) + template[pos:]
        elif op == 1:
            template = template[:pos] + template[pos + rng.randrange(1, 40):]
        elif op == 2:
            q = rng.randrange(len(template) + 1)
            template = template[:pos] + template[q:q + rng.randrange(1, 80)] + template[pos:]
        else:
            raw = mutate_bytes(template.encode("utf-8"), rng)
            template = raw.decode("utf-8", "replace")
    elif r < 0.8:
        messages = mutate_json_value(messages, rng)
    else:
        kwargs = mutate_json_value(kwargs if isinstance(kwargs, dict) else {}, rng)
    return json.dumps({"template": template, "messages": messages, "kwargs": kwargs}).encode()


def mutate_depth_doc(data: bytes, rng: random.Random) -> bytes:
    """template_depth: a template that nests deeper, uses what it built, loops or recurses more."""
    try:
        doc = json.loads(data)
        template = doc["template"]
    except (ValueError, KeyError, TypeError):
        return data
    if not isinstance(template, str):
        return data
    r = rng.random()
    numbers = [m.span() for m in re.finditer(r"\d+", template)]
    tags = [m.start() for m in re.finditer(r"\{[%{]", template)] + [len(template)]
    pos = rng.choice(tags)
    if r < 0.3 and numbers:                 # more iterations, deeper recursion
        a, b = rng.choice(numbers)
        template = template[:a] + str(rng.choice(DEPTH_NUMBERS)) + template[b:]
    elif r < 0.55:                          # another layer of wrapping, k deep
        k = rng.choice([1, 2, 8, 60, 100])
        value = "ns.t"
        for _ in range(k):
            value = rng.choice(DEPTH_WRAPS).format(value)
        template = template[:pos] + "{% set ns.t = " + value + " %}" + template[pos:]
    elif r < 0.75:
        template = template[:pos] + rng.choice(DEPTH_USES) + template[pos:]
    elif r < 0.9:
        template = template[:pos] + rng.choice(DEPTH_SNIPPETS) + template[pos:]
    else:
        return mutate_template_doc(data, rng)
    doc["template"] = template
    return json.dumps(doc).encode()


BINARY_FILE = {"hf": "model.safetensors", "corelm": "weights.corelm"}


def mutate(target: str, seed: Any, rng: random.Random, others: List[Any]) -> Any:
    x = seed
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 4])):
        if target == "gguf":
            other = rng.choice(others)
            x = mutate_bytes(x, rng, other if isinstance(other, bytes) else None)
        elif target == "template":
            x = mutate_template_doc(x, rng)
        elif target == "template_depth":
            x = mutate_depth_doc(x, rng)
        else:
            x = mutate_folder(x, rng, BINARY_FILE[target])
    return x


def write_input(target: str, x: Any, path: str) -> str:
    """Writes input x at path (a file, or a folder for folder targets); returns what to load."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    if isinstance(x, dict):
        os.makedirs(path)
        for fname, data in x.items():
            with open(os.path.join(path, fname), "wb") as f:
                f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(x)
    return path


# ---------------------------------------------------------------------------------------------------
# The worker: runs inputs in a separate process, one line of JSON per answer.

def _exercise_model(path: str) -> None:
    from corelm.engine.model_builder import rope_inv_freq
    from corelm.loader import load_model
    m = load_model(path)
    for name in m.weight_names():
        m.get_weight(name)
        if m.get_raw_weight is not None:
            m.get_raw_weight(name)
    rope_inv_freq(m.spec)
    tok = m.tokenizer
    ids = tok.encode("hello world, a!")
    tok.decode(ids)
    det = tok.detokenizer()
    for i in ids:
        det.add(i)


def _run_template(path: str) -> None:
    from corelm.tokenizer.chat_template import render_chat_template
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    kwargs = doc.get("kwargs") if isinstance(doc.get("kwargs"), dict) else {}
    kwargs = {k: v for k, v in kwargs.items() if isinstance(k, str) and k.isidentifier()
              and k not in ("messages", "add_generation_prompt", "special_tokens", "template")}
    messages = doc.get("messages")
    try:
        render_chat_template(doc.get("template"), messages, add_generation_prompt=True,
                             special_tokens={"bos_token": "<s>", "eos_token": "</s>"}, **kwargs)
    except ValueError as e:
        # The renderer's documented precondition: messages is a list of dicts that each have a 'role';
        # a plain ValueError is the answer to a conversation that breaks it, and only to that.
        from corelm.tokenizer.chat_template import ChatTemplateError
        if isinstance(e, ChatTemplateError) or _messages_ok(messages):
            raise
        raise _PreconditionRefused(str(e)) from None


class _PreconditionRefused(Exception):
    pass


def _messages_ok(messages: Any) -> bool:
    return isinstance(messages, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in messages)


def _run_selftest(path: str) -> None:
    """The harness's own check (tests/loaders/test_fuzz.py): the input says how to fail."""
    with open(path, "rb") as f:
        what = f.read().strip()
    if what == b"crash":
        os.abort()
    if what == b"hang":
        time.sleep(3600)
    if what == b"foreign":
        raise KeyError("foreign")
    if what == b"refused":
        from corelm.loader import ModelLoadError
        raise ModelLoadError("refused")


def worker(target: str) -> None:
    import logging
    import resource
    import traceback
    import warnings
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    logging.disable(logging.CRITICAL)
    warnings.simplefilter("ignore")
    from corelm.loader import ModelLoadError
    from corelm.tokenizer.chat_template import ChatTemplateError
    expected = (ChatTemplateError, _PreconditionRefused) if target in TEMPLATE_TARGETS else ModelLoadError
    run = {"template": _run_template, "template_depth": _run_template, "selftest": _run_selftest}.get(
        target, _exercise_model)
    out = sys.stdout
    sys.stdout = sys.stderr          # anything the code under test prints must not corrupt the protocol
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        path = line.rstrip("\n")
        try:
            run(path)
            answer = {"status": "ok"}
        except expected as e:
            answer = {"status": "refused", "error": str(e)[:300]}
        except BaseException as e:   # noqa: B902 - PanicException and friends are what we are looking for
            if isinstance(e, KeyboardInterrupt):
                raise
            answer = {"status": "foreign", "error": f"{type(e).__name__}: {str(e)[:500]}",
                      "where": "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])[-3000:]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _corelm_root() -> str:
    """Where this process imports corelm from (an installed package, or the checkout's python/), so the
    worker tests the same code."""
    import importlib.util
    spec = importlib.util.find_spec("corelm")
    if spec is not None and spec.origin:
        return os.path.dirname(os.path.dirname(spec.origin))
    return os.path.join(REPO, "python")


class Worker:
    def __init__(self, target: str, timeout: float):
        self.target, self.timeout = target, timeout
        self.proc: Optional[subprocess.Popen] = None
        self.stderr_path = tempfile.mktemp(prefix="corelm-fuzz-stderr-")

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=_corelm_root() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   RUST_BACKTRACE="0", OMP_NUM_THREADS="1")
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", self.target],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)
        line = self._readline(120.0)
        if line != "ready":
            raise RuntimeError(f"fuzz worker for {self.target} did not start: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _readline(self, timeout: float) -> Optional[str]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        line = fd.readline()
        return line.decode("utf-8", "replace").rstrip("\n") if line else ""

    def run(self, path: str) -> Dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((path + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        line = self._readline(self.timeout)
        if line is None:
            self.stop()
            return {"status": "hang", "error": f"no answer within {self.timeout} s"}
        if line == "":
            return self._died()
        return json.loads(line)

    def _died(self) -> Dict[str, Any]:
        assert self.proc is not None
        rc = self.proc.wait()
        self.proc = None
        return {"status": "crash", "error": f"worker exited with status {rc}", "where": self.stderr_tail()}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        try:
            os.remove(self.stderr_path)
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------
# The loop.

FAILURES = ("crash", "hang", "foreign")


def fuzz(target: str, seconds: float, seed: int, timeout: float = 10.0, failures_dir: Optional[str] = None,
         seeds_root: str = FUZZ_DIR, max_inputs: Optional[int] = None, verbose: bool = True) -> Dict[str, Any]:
    if target == "server":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from fuzz_server import fuzz_server
        return fuzz_server(seconds, seed, failures_dir or os.path.join(os.getcwd(), "fuzz-failures", target), REPO,
                           lambda data, rng: mutate_bytes(data, rng), verbose, max_inputs, _corelm_root())
    seeds = load_seeds(target, seeds_root)
    rng = random.Random(f"{target}:{seed}")
    failures_dir = failures_dir or os.path.join(os.getcwd(), "fuzz-failures", target)
    counts = {k: 0 for k in ("ok", "refused") + FAILURES}
    found: List[Dict[str, Any]] = []
    seed_problems: List[str] = []     # seeds must load (render) cleanly, but for the nomodel_* and refused_* ones
    w = Worker(target, timeout)
    scratch = tempfile.mkdtemp(prefix=f"corelm-fuzz-{target}-")
    ext = {"gguf": ".gguf", "template": ".json", "template_depth": ".json"}.get(target, "")
    t0 = time.monotonic()
    w.start()
    n = 0
    try:
        while time.monotonic() - t0 < seconds and (max_inputs is None or n < max_inputs):
            # the seeds themselves first, then mutants
            name, x = seeds[n] if n < len(seeds) else rng.choice(seeds)
            if n >= len(seeds):
                x = mutate(target, x, rng, [s for _, s in seeds])
            path = write_input(target, x, os.path.join(scratch, f"input{ext}"))
            answer = w.run(path)
            n += 1
            if n <= len(seeds) and answer["status"] != "ok" and not name.startswith(("nomodel_", "refused_")):
                seed_problems.append(f"{name}: {answer['status']}: {answer.get('error')}")
            counts[answer["status"]] += 1
            if answer["status"] in FAILURES:
                saved = _save_failure(failures_dir, target, n, name, path, answer)
                found.append(dict(answer, input=saved, seed=name))
                if verbose:
                    print(f"[{target}] {answer['status']}: {answer['error']} (input saved to {saved})", flush=True)
    finally:
        w.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.monotonic() - t0
    result = {"target": target, "inputs": n, "seconds": round(elapsed, 1), "counts": counts, "failures": found,
              "seed_problems": seed_problems}
    if verbose:
        print(f"{target}: {n} inputs in {elapsed:.1f} s ({n / max(elapsed, 1e-9):.0f}/s): " +
              ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return result


def _save_failure(root: str, target: str, n: int, seed_name: str, path: str, answer: Dict[str, Any]) -> str:
    dest = os.path.join(root, f"{answer['status']}-{n:06d}")
    os.makedirs(dest, exist_ok=True)
    if os.path.isdir(path):
        shutil.copytree(path, os.path.join(dest, "input"), dirs_exist_ok=True)
    else:
        shutil.copyfile(path, os.path.join(dest, "input" + os.path.splitext(path)[1]))
    with open(os.path.join(dest, "what.json"), "w") as f:
        json.dump(dict(answer, target=target, seed=seed_name,
                       reproduce=f"python tools/fuzz/fuzz.py --target {target} --replay {dest}"), f, indent=2)
    return dest


def replay(target: str, dest: str, timeout: float) -> Dict[str, Any]:
    """Runs a saved failing input again (its input or input.* under dest)."""
    path = next(os.path.join(dest, p) for p in sorted(os.listdir(dest)) if p.startswith("input"))
    w = Worker(target, timeout)
    try:
        w.start()
        return w.run(path)
    finally:
        w.stop()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--target", choices=TARGETS + ("all", "server"), default="all")
    ap.add_argument("--seconds", type=float, default=60.0, help="per target")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=10.0, help="per input, seconds (a miss counts as a hang)")
    ap.add_argument("--max-inputs", type=int, default=None)
    ap.add_argument("--failures", default=None, help="folder for failing inputs (default fuzz-failures/<target>)")
    ap.add_argument("--make-seeds", action="store_true", help="(re)write tests/data/fuzz/ and exit")
    ap.add_argument("--replay", metavar="DIR", help="run one saved failure again")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--worker", choices=TARGETS + ("selftest",), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.make_seeds:
        made = make_seeds()
        print("wrote " + ", ".join(f"{len(v)} {k}" for k, v in made.items()) + f" seeds to {FUZZ_DIR}")
        return 0
    if args.replay:
        print(json.dumps(replay(args.target, args.replay, args.timeout), indent=2))
        return 0
    targets = TARGETS if args.target == "all" else (args.target,)
    results = []
    for t in targets:
        failures = os.path.join(args.failures, t) if args.failures and len(targets) > 1 else args.failures
        results.append(fuzz(t, args.seconds, args.seed, args.timeout, failures, max_inputs=args.max_inputs,
                            verbose=not args.json))
    if args.json:
        print(json.dumps(results))
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
