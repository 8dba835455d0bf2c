"""A model across processes (python/corelm/engine/distributed/). Tensor parallelism: the shard plan, each family's
shards against the whole model in one process (a thread per rank, summing through a barrier), and real MPI ranks
through every entry point: LLM(tensor_parallel_size=2) launching its ranks over shared memory and over TCP
loopback, an MPI launcher's ranks, `corelm serve --tensor-parallel-size 2` with the openai client, and a killed
rank. Pipeline parallelism: the stage plan, and stages over MPI giving one process's output bit for bit."""
import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from conftest import DEFAULT_GGUF, MODELS, ROOT, child_env

from corelm.engine.distributed.shard import pipeline_plan, plan
from corelm.engine.model_builder import build_core_model
from corelm.loader import load_model

STORIES = os.path.join(MODELS, "stories260K")
FAMILIES = ["stories260K", "tiny-qwen2", "tiny-llama3", "tiny-mistral", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3",
            "tiny-phi3", "tiny-mixtral", "tiny-qwen3moe", "tiny-olmoe"]
# MPICH on TCP sockets only (tools/bench/bench_allreduce.py): no shared memory between the local ranks
TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp", "FI_PROVIDER": "tcp"}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day"]

mpi4py = pytest.importorskip("mpi4py", reason='tensor parallelism needs pip install "corelm[distributed]"')


# ---------------------------------------------------------------------------------------------------
# The plan

def spec_of(name):
    return load_model(os.path.join(MODELS, name)).spec


def test_the_shards_cover_the_model_once():
    spec = spec_of("tiny-qwen2")   # 4 query heads over 2 kv heads, MLP 160, vocabulary 512
    shards = plan(spec, 2)
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2)] and [s.heads for s in shards] == [(0, 2), (2, 4)]
    assert [s.ffn for s in shards] == [(0, 96), (96, 160)]          # whole blocks of 32
    assert [s.vocab for s in shards] == [(0, 256), (256, 512)]
    assert shards[0].cut("layers.3.wo") == (1, 0, 32) and shards[1].cut("layers.0.bk") == (0, 16, 32)
    assert shards[1].cut("layers.0.w_down") == (1, 96, 160) and shards[0].cut("norm") is None


def test_more_ranks_than_kv_heads_copy_a_kv_head_and_cut_its_queries():
    shards = plan(spec_of("tiny-qwen2"), 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("size", [0, -1, 3, 5, True, 2.0])
def test_sizes_that_do_not_fit_are_refused(size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan(spec_of("tiny-qwen2"), size)


def test_a_column_cut_through_quantized_blocks_falls_back_to_floats():
    s = plan(spec_of("tiny-qwen2"), 2)[1]
    q8 = ("Q8_0", np.arange(64 * 2 * 34).astype(np.uint8).reshape(64, 68), (64, 64))
    kind, data, shape = s.slice_raw("layers.0.wo", q8)               # columns 32..64: the second block of 32
    assert (kind, shape) == ("Q8_0", (64, 32)) and (data == q8[1][:, 34:]).all()
    kind, data, shape = s.slice_raw("layers.0.wq", q8)               # rows: always
    assert (kind, shape) == ("Q8_0", (32, 64)) and (data == q8[1][32:]).all()
    q4k = ("Q4_K", np.zeros((64, 144), np.uint8), (64, 256))
    assert s.slice_raw("layers.0.wo", q4k) is None                   # columns 32..64 of a block of 256


# ---------------------------------------------------------------------------------------------------
# Shards in one process

def shard_logits(path, size, dtype, tokens):
    """The logits of `tokens` through `size` shards, a thread each, their partial sums added through a barrier."""
    cores = [build_core_model(load_model(path), dtype=dtype, threads=1, max_seq_len=64, pin_threads=False, shard=s)
             for s in plan(load_model(path).spec, size)]
    barrier, parts = threading.Barrier(size), [None] * size

    def allreduce(rank):
        def run(address, n):
            a = np.ctypeslib.as_array((ctypes.c_float * n).from_address(address))
            parts[rank] = a.copy()
            barrier.wait()
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            barrier.wait()
            a[:] = total
        return run
    for r, c in enumerate(cores):
        c.set_allreduce(allreduce(r))
    out = [None] * size
    table = np.arange(4, dtype=np.int32)

    def forward(r):
        out[r] = cores[r].forward_batch(tokens, [(len(tokens), 0, table, True)])
    threads = [threading.Thread(target=forward, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_cut_in_two_gives_the_whole_models_logits(name):
    path = os.path.join(MODELS, name)
    tokens = np.array([1, 5, 9, 33, 2, 7, 100, 3], np.int32)
    whole = build_core_model(load_model(path), dtype="fp32", threads=1, max_seq_len=64, pin_threads=False)
    want = whole.forward_batch(tokens, [(len(tokens), 0, np.arange(4, dtype=np.int32), True)])
    if plan_fits(path, 2):
        got = shard_logits(path, 2, "fp32", tokens)
        assert np.abs(got - want).max() < 1e-4 and (got.argmax(1) == want.argmax(1)).all()


def plan_fits(path, size):
    try:
        plan(load_model(path).spec, size)
        return True
    except ValueError:
        return False


def test_three_shards_and_quantized_blocks():
    tokens = np.array([1, 5, 9, 33, 2, 7], np.int32)
    whole = build_core_model(load_model(DEFAULT_GGUF), dtype="auto", threads=1, max_seq_len=64, pin_threads=False)
    want = whole.forward_batch(tokens, [(len(tokens), 0, np.arange(4, dtype=np.int32), True)])
    got = shard_logits(DEFAULT_GGUF, 3, "auto", tokens)   # Q4_1/Q8_0 blocks cut as stored, bf16 KV cache
    assert (got.argmax(1) == want.argmax(1)).all() and np.abs(got - want).max() < 0.5


# ---------------------------------------------------------------------------------------------------
# MPI ranks

def run_script(code, *args, env=None, timeout=240, launcher=None):
    cmd = (launcher or []) + [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.run(cmd, env=child_env(**(env or {})), capture_output=True, text=True, cwd=ROOT, timeout=timeout)


GREEDY = """
    import json, sys, corelm
    path, dtype, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[6])
    llm = corelm.LLM(path, dtype=dtype, threads=1, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    p = corelm.SamplingParams(temperature=0, max_tokens=int(sys.argv[4]), logprobs=2, ignore_eos=True)
    outs = llm.generate(json.loads(sys.argv[5]), p)
    print("RESULT", json.dumps([[o.outputs[0].token_ids, [sorted(v.logprob for v in lp.values())[-2:] for lp in o.outputs[0].logprobs]] for o in outs]))
"""


def greedy(path, dtype, tp, tokens=24, env=None, launcher=None, pp=1):
    r = run_script(GREEDY, path, dtype, str(tp), str(tokens), json.dumps(PROMPTS), str(pp), env=env, launcher=launcher)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:])


@pytest.mark.parametrize("name", ["stories260K", "tiny-olmoe", "tiny-gemma2"])
def test_two_ranks_over_shared_memory_decode_as_one_process(name):
    path = os.path.join(MODELS, name)
    assert [t for t, _ in greedy(path, "fp32", 2)] == [t for t, _ in greedy(path, "fp32", 1)]


PYTHON_ALLREDUCE = """
    import json, sys, corelm
    from corelm.engine.distributed import parallel
    parallel.mpich_calls = lambda MPI: None      # rank 0 sums through mpi4py (an MPI of another ABI), rank 1 from C++
    llm = corelm.LLM(sys.argv[1], dtype="fp32", threads=1, tensor_parallel_size=2)
    outs = llm.generate(json.loads(sys.argv[2]), corelm.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    print("RESULT", json.dumps([o.outputs[0].token_ids for o in outs]))
"""


def test_the_mpi4py_allreduce_agrees_with_the_one_called_from_cpp():
    r = run_script(PYTHON_ALLREDUCE, STORIES, json.dumps(PROMPTS))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:])
    assert got == [t for t, _ in greedy(STORIES, "fp32", 1)]


def test_two_ranks_over_tcp_decode_as_one_process():
    assert [t for t, _ in greedy(STORIES, "fp32", 2, env=TCP_ENV)] == [t for t, _ in greedy(STORIES, "fp32", 1)]


def test_an_mpi_launchers_ranks_are_used():
    one = [t for t, _ in greedy(STORIES, "fp32", 1)]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert [t for t, _ in greedy(STORIES, "fp32", 2, launcher=[mpiexec, "-n", "2"])] == one


def test_quantized_ranks_agree_until_a_near_tie():
    """Q4_1/Q8_0 blocks with int16 activations and a bf16 cache: the ranks' partial sums round differently from one
    process's, so a token may differ only where the one process's top two were within 0.1 nats."""
    whole, cut = greedy(DEFAULT_GGUF, "auto", 1, tokens=32), greedy(DEFAULT_GGUF, "auto", 2, tokens=32)
    for (want, tops), (got, _) in zip(whole, cut):
        first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if first is not None:
            assert tops[first][1] - tops[first][0] < 0.1, (first, want, got)


SPEC_AND_GRAMMAR = """
    import json, corelm, sys
    from corelm.engine.sampling import StructuredOutputsParams
    llm = corelm.LLM(sys.argv[1], dtype="fp32", threads=1, tensor_parallel_size=int(sys.argv[2]),
                     speculative_model="[ngram]")
    text = "one two three four one two three four one two"
    a = llm.generate([text], corelm.SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
    b = llm.generate(["Pick:"], corelm.SamplingParams(temperature=0, max_tokens=8,
                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0].outputs[0].text
    print("RESULT", json.dumps([a, b]))
"""


def test_speculative_decoding_and_structured_output_work_across_ranks():
    def result(tp):
        r = run_script(SPEC_AND_GRAMMAR, STORIES, str(tp))
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))[7:])
    one, two = result(1), result(2)
    assert two == one and two[1] in ("yes", "no")


KILLED = """
    import os, signal, sys, time, corelm
    from corelm.errors import EngineDead
    llm = corelm.LLM(sys.argv[1], dtype="fp32", threads=1, tensor_parallel_size=2)
    os.kill(llm.engine.core._group.peers[1][1], signal.SIGKILL)
    for attempt in range(2):
        t = time.monotonic()
        try:
            llm.generate(["Once upon a time"], corelm.SamplingParams(temperature=0, max_tokens=8))
            print("NO ERROR")
        except EngineDead as e:
            print("FAILED", round(time.monotonic() - t, 2), e, flush=True)
"""


def test_a_killed_rank_is_an_error_within_seconds_not_a_hang():
    r = run_script(KILLED, STORIES, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    failed = [l.split(" ", 2) for l in r.stdout.splitlines() if l.startswith("FAILED")]
    assert len(failed) == 2 and all(float(s) < 5 for _, s, _ in failed), r.stdout
    assert "rank 1" in failed[0][2] and "died" in failed[0][2]


# ---------------------------------------------------------------------------------------------------
# corelm serve --tensor-parallel-size 2

def _serve(port, flag):
    cmd = [sys.executable, "-m", "corelm.entrypoints.cli", "serve", STORIES, "--port", str(port), "--dtype", "fp32",
           "-t", "1", flag, "2"]
    return subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_serve_with_two_ranks_answers_the_openai_client_as_one_process(flag):
    import openai
    import corelm
    from test_server import _free_port, wait_healthy
    want = [o.outputs[0].text for o in corelm.LLM(STORIES, dtype="fp32", threads=1).generate(
        PROMPTS, corelm.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    port = _free_port()
    proc = _serve(port, flag)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        for prompt, text in zip(PROMPTS, want):
            r = client.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 16 and r.choices[0].text == text
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="x", prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}))
            assert text == r.choices[0].text
        # the follower dies: requests fail with a clear error, /health says so, and the server exits nonzero
        import psutil
        followers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "corelm.engine.distributed.follower" in " ".join(p.cmdline())]
        assert followers
        followers[0].kill()
        with pytest.raises(openai.APIError):
            client.completions.create(model="x", prompt="Once", max_tokens=8, temperature=0)
        assert proc.wait(20) != 0
        assert "rank 1" in proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(20)


# ---------------------------------------------------------------------------------------------------
# Pipeline parallelism

def test_stages_hold_consecutive_layers():
    spec = spec_of("stories260K")    # 5 layers
    stages = pipeline_plan(spec, 2)
    assert [s.layers for s in stages] == [(0, 3), (3, 5)]
    names = stages[1].weight_names(["tok_embeddings", "layers.0.wq", "layers.3.wq", "layers.4.w_down", "norm"])
    assert names == ["tok_embeddings", "layers.0.wq", "layers.1.w_down", "norm"]
    assert stages[1].source("layers.1.w_down") == "layers.4.w_down"
    with pytest.raises(ValueError, match="exceeds the model's 5 layers"):
        pipeline_plan(spec, 6)


@pytest.mark.parametrize("path,dtype,stages", [(STORIES, "fp32", 2), (os.path.join(MODELS, "tiny-gemma3"), "fp32", 2),
                                               (DEFAULT_GGUF, "auto", 3)])
def test_pipeline_stages_give_one_processs_output_bit_for_bit(path, dtype, stages):
    """Each stage runs its layers on the hidden states the one before handed it: the same operations in the same
    order as one process, so the same tokens and the same log-probabilities, quantized blocks included."""
    assert greedy(path, dtype, 1, pp=stages) == greedy(path, dtype, 1)


def test_pipeline_stages_over_tcp():
    assert greedy(STORIES, "fp32", 1, pp=2, env=TCP_ENV) == greedy(STORIES, "fp32", 1)


def test_tensor_and_pipeline_together_are_refused_with_a_clear_error():
    r = run_script("import corelm, sys; corelm.LLM(sys.argv[1], tensor_parallel_size=2, pipeline_parallel_size=2)",
                   STORIES)
    assert r.returncode != 0 and "cannot both be above 1" in r.stderr


def test_batch_with_two_ranks_per_worker_answers_as_one_process(tmp_path):
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": p, "max_tokens": 12, "temperature": 0}}) for i, p in enumerate(PROMPTS)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")

    def answers(*flags):
        out = tmp_path / f"out{len(flags)}.jsonl"
        r = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "batch", STORIES, str(src), "-o", str(out),
                            "--no-progress", "-w", "1", "-t", "1", "--dtype", "fp32", *flags],
                           env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [json.loads(line) for line in out.read_text().splitlines()]
        return {rec["custom_id"]: rec["response"]["body"]["choices"][0]["text"] for rec in recs}
    assert answers("--tensor-parallel-size", "2") == answers()


def test_a_corrupt_model_file_is_a_model_load_error_and_no_rank_is_left(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    code = """
    import sys, corelm
    try:
        corelm.LLM(sys.argv[1], tensor_parallel_size=2, threads=1)
    except corelm.ModelLoadError as e:
        print("REFUSED", e)
    """
    r = run_script(code, str(bad), timeout=60)
    assert r.returncode == 0 and "REFUSED" in r.stdout, r.stdout + r.stderr[-2000:]
