"""LoRA adapters per request (engine/lora.py, loader/lora.py, cpp/model/lora.h): an adapter applied as separate
low-rank products gives, in fp32, what the base weights with the adapter merged give; a batch mixing adapters and
the base model gives each request what it gets alone; PEFT folders and llama.cpp's GGUF LoRA files load to the same
adapter; bad adapters are refused saying why."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import MODELS
from corelm import SamplingParams
from corelm.errors import ModelLoadError
from corelm.lora.request import LoRARequest

STORIES = os.path.join(MODELS, "stories260K")   # ffn 172: a partial gate/up block; 8 heads, 4 kv heads
HF_MODULES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
              "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
GGUF_MODULES = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
                "w_up": "ffn_up", "w_down": "ffn_down"}
PROMPT = [1, 365, 170, 263, 93, 292, 27, 471, 263, 217, 78, 257, 365, 235, 29, 296, 131, 304, 170, 411]


def read_safetensors(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: np.frombuffer(data[v["data_offsets"][0]:v["data_offsets"][1]], dtype=np.float32).reshape(v["shape"])
            for k, v in header.items()}


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = np.ascontiguousarray(v, dtype=np.float32).tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def random_adapter(rank, seed, parts=tuple(HF_MODULES), layers=range(5)):
    """{(layer, part): (A [rank, in], B [out, rank])} for stories260K, large enough to change the output."""
    rng = np.random.default_rng(seed)
    shapes = {"wq": (64, 64), "wk": (32, 64), "wv": (32, 64), "wo": (64, 64), "w_gate": (172, 64), "w_up": (172, 64),
              "w_down": (64, 172)}
    return {(i, p): (rng.normal(0, 0.15, (rank, shapes[p][1])).astype(np.float32),
                     rng.normal(0, 0.15, (shapes[p][0], rank)).astype(np.float32)) for i in layers for p in parts}


def write_peft(folder, adapter, rank, alpha, **config):
    os.makedirs(folder, exist_ok=True)
    parts = sorted({p for _, p in adapter})
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
           "target_modules": [HF_MODULES[p].split(".")[1] for p in parts], **config}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {}
    for (i, p), (a, b) in adapter.items():
        name = f"base_model.model.model.layers.{i}.{HF_MODULES[p]}"
        tensors[name + ".lora_A.weight"], tensors[name + ".lora_B.weight"] = a, b
    write_safetensors(os.path.join(folder, "adapter_model.safetensors"), tensors)
    return str(folder)


def merged_model(folder, adapter, scale):
    """stories260K's folder with W + scale * B A written into its weights."""
    shutil.copytree(STORIES, folder, ignore=shutil.ignore_patterns("*.gguf"))
    path = os.path.join(folder, "model.safetensors")
    w = dict(read_safetensors(path))
    for (i, p), (a, b) in adapter.items():
        name = f"model.layers.{i}.{HF_MODULES[p]}.weight"
        w[name] = w[name] + scale * (b.astype(np.float64) @ a.astype(np.float64)).astype(np.float32)
    write_safetensors(path, w)
    return str(folder)


def make_llm(model, **options):
    import corelm
    return corelm.LLM(model, dtype="fp32", threads=2, max_seq_len=256, speculative_model=None, **options)


def prompt_logits(llm, lora=None):
    """Every prompt token's logits through the adapter (None: the base model), computed from scratch."""
    engine = llm.engine
    adapter = -1 if lora is None else engine.loras.resolve(lora)
    blocks = np.arange(-(-len(PROMPT) // engine.core.kv_block_size), dtype=np.int32)
    return engine.core.forward_batch(np.asarray(PROMPT, np.int32), [(len(PROMPT), 0, blocks, True, adapter)])


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    one, two = random_adapter(8, 1), random_adapter(4, 2, parts=("wq", "wv", "w_up", "w_down"), layers=(0, 2, 4))
    return {"one": (one, write_peft(root / "one", one, 8, 16)), "two": (two, write_peft(root / "two", two, 4, 2)),
            "root": root}


@pytest.fixture(scope="module")
def llm():
    return make_llm(STORIES, enable_lora=True, max_loras=2, enable_prefix_caching=True)


def test_adapter_equals_the_merged_weights(adapters, llm, tmp_path):
    one, path = adapters["one"]
    merged = make_llm(merged_model(tmp_path / "merged", one, 16 / 8))
    lora = LoRARequest("one", 1, path)
    want = prompt_logits(merged)
    got = prompt_logits(llm, lora)
    assert not np.allclose(prompt_logits(llm), want, atol=1e-2)        # the adapter changes the output
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    out = llm.generate([PROMPT], GREEDY, lora_request=lora)[0].outputs[0].token_ids
    assert out == merged.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def test_rslora_and_the_callers_scale(adapters, llm, tmp_path):
    one, _ = adapters["one"]
    path = write_peft(tmp_path / "rs", one, 8, 16, use_rslora=True)
    merged = make_llm(merged_model(tmp_path / "merged", one, 0.5 * 16 / np.sqrt(8)))
    got = prompt_logits(llm, LoRARequest("rs", 7, path, scale=0.5))
    np.testing.assert_allclose(got, prompt_logits(merged), rtol=1e-4, atol=1e-4)
    llm.engine.remove_lora(7)


def test_a_batch_mixing_adapters_and_the_base_gives_each_what_it_gets_alone(adapters, llm):
    loras = [LoRARequest("one", 1, adapters["one"][1]), LoRARequest("two", 2, adapters["two"][1]), None]
    prompts = [PROMPT, PROMPT[:11], PROMPT[3:]]
    alone = [llm.generate([p], GREEDY, lora_request=r)[0].outputs[0].token_ids for p, r in zip(prompts, loras)]
    assert len({tuple(a) for a in alone}) == 3
    # the same prompt under each: the prefix cache must not hand one adapter's blocks to another
    together = llm.generate(prompts * 2, GREEDY, lora_request=loras + loras[::-1])
    assert [o.outputs[0].token_ids for o in together[:3]] == alone
    same = [llm.generate([PROMPT], GREEDY, lora_request=r)[0].outputs[0].token_ids for r in loras]
    assert len({tuple(a) for a in same}) == 3
    # one pass over three sequences, each through its own adapter, against each alone: the same bits (at most
    # 32 rows, which every matmul computes row by row in decode's order)
    core, ids = llm.engine.core, [llm.engine.loras.resolve(r) if r else -1 for r in loras]
    prompts = [PROMPT[:12], PROMPT[2:12], PROMPT[5:13]]
    tables = [np.arange(k * 4, k * 4 + 4, dtype=np.int32) for k in range(3)]
    seqs = [(len(p), 0, t, True, a) for p, t, a in zip(prompts, tables, ids)]
    batch = core.forward_batch(np.asarray(sum(prompts, []), np.int32), seqs)
    row = 0
    for p, t, a in zip(prompts, tables, ids):
        single = core.forward_batch(np.asarray(p, np.int32), [(len(p), 0, t, True, a)])
        np.testing.assert_array_equal(batch[row:row + len(p)], single)
        row += len(p)


def permute_rows(w, n_head):
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_lora_equals_the_peft_adapter(adapters, llm, tmp_path):
    gguf = pytest.importorskip("gguf")
    one, path = adapters["one"]
    out = str(tmp_path / "one.gguf")
    w = gguf.GGUFWriter(out, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 16.0)
    heads = {"wq": 8, "wk": 4}
    for (i, p), (a, b) in one.items():
        name = f"blk.{i}.{GGUF_MODULES[p]}.weight"
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", permute_rows(b, heads[p]) if p in heads else b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    np.testing.assert_allclose(prompt_logits(llm, LoRARequest("g", 9, out)),
                               prompt_logits(llm, LoRARequest("one", 1, path)), rtol=1e-5, atol=1e-5)
    llm.engine.remove_lora(9)


def test_bad_adapters_are_refused_saying_why(adapters, llm, tmp_path):
    from corelm.loader.lora import load_lora
    one, _ = adapters["one"]
    spec = llm.engine.spec
    small = {k: v for k, v in one.items() if k[0] == 0}

    def refused(folder, match, **config):
        with pytest.raises(ModelLoadError, match=match):
            load_lora(str(folder), spec)
    refused(write_peft(tmp_path / "bias", small, 8, 8, bias="all"), "bias")
    refused(write_peft(tmp_path / "dora", small, 8, 8, use_dora=True), "DoRA")
    refused(write_peft(tmp_path / "emb", small, 8, 8, target_modules=["q_proj", "embed_tokens"]), "embeddings")
    head = write_peft(tmp_path / "head", small, 8, 8)
    t = read_safetensors(os.path.join(head, "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = np.zeros((8, 64), np.float32)
    t["base_model.model.lm_head.lora_B.weight"] = np.zeros((512, 8), np.float32)
    write_safetensors(os.path.join(head, "adapter_model.safetensors"), t)
    refused(head, "lm_head")
    bad = {(0, "wq"): (np.zeros((8, 64), np.float32), np.zeros((60, 8), np.float32))}
    refused(write_peft(tmp_path / "shape", bad, 8, 8), "rows")
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    (pickle / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8}')
    (pickle / "adapter_model.bin").write_bytes(b"\x80\x04")
    refused(pickle, "pickle")
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm(STORIES).generate([PROMPT], GREEDY, lora_request=LoRARequest("one", 1, adapters["one"][1]))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'one'"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("other", 1, str(tmp_path / "x")))
