"""`corelm batch`: OpenAI Batch JSONL through worker processes, on the tiny stories260K model.

Covers the line format (chat, completion, malformed lines), resuming (ids already in OUT are skipped,
a truncated last line is repaired), a worker dying mid-run (its task is redone elsewhere; every
custom_id appears exactly once), the CPU split per worker, and the Ray backend on a local cluster."""
import json
import os
import signal
import threading
import time

import pytest

from conftest import BATCH_CRASH, batch_crash_env
from corelm.entrypoints import cli
from corelm.entrypoints.batch import parse_line, run_batch, split_cpus, BatchLineError
from corelm.entrypoints.batch.runner import ProcessBackend, load_done
from corelm.engine.placement import numa_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests", "data", "models", "stories260K")


def chat_line(cid, text="Hi", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                     "temperature": 0, **body}}


def completion_line(cid, prompt="Once upon a time", **body):
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 8, "temperature": 0, **body}}


def write_input(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def read_output(path):
    with open(path) as f:
        return [json.loads(line) for line in f]      # every line must be valid JSON


def ids_of(records):
    return [r["custom_id"] for r in records if r["custom_id"] is not None]


def mixed(n):
    return [chat_line(f"c{i}", f"Tell me about {i}") if i % 2 else completion_line(f"p{i}", f"Once upon a time {i}")
            for i in range(n)]


def kill_once_results_flow(out, kill, timeout=60):
    """An on_start hook: a thread that calls kill(backend) as soon as OUT has its first line, so
    worker 0 dies while the run is under way."""
    def start(backend):
        def go():
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if os.path.exists(out) and os.path.getsize(out) > 0:
                    return kill(backend)
                time.sleep(0.01)
        threading.Thread(target=go, daemon=True).start()
    return start


# ---------------------------------------------------------------------------------------------------
# Pure parts

def test_split_cpus_one_node_per_worker_or_disjoint_slices():
    two_nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert split_cpus(2, range(8), two_nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cpus(4, range(8), two_nodes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cpus(1, range(8), two_nodes) == [[0, 1, 2, 3]]                 # one node, local memory
    assert split_cpus(2, [0, 1], {0: [0, 1]}) == [[0], [1]]                       # this machine's shape
    assert split_cpus(2, [0, 1, 2, 3], {}) == [[0, 1], [2, 3]]                     # no sysfs node list
    assert split_cpus(2, [4, 5, 6], {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}) == [[4], [5, 6]]   # only allowed CPUs
    assert split_cpus(3, [0, 1], {0: [0, 1]}) == [[0], [1], [0]]                  # more workers than CPUs
    with pytest.raises(ValueError):
        split_cpus(0, [0, 1], {})


def test_numa_nodes_come_from_the_core_topology():
    """The nodes are the C++ core's reading of sysfs (here a recorded 4-node EPYC tree)."""
    nodes = numa_nodes(os.path.join(ROOT, "tests", "data", "topology", "epyc-4node"))
    assert sorted(nodes) == [0, 1, 2, 3] and nodes[1] == [4, 5, 6, 7, 20, 21, 22, 23]
    assert split_cpus(4, range(32), nodes) == [nodes[0], nodes[1], nodes[2], nodes[3]]
    assert split_cpus(8, range(32), nodes)[:2] == [[0, 1, 2, 3], [16, 17, 18, 19]]


def test_parse_line_accepts_both_endpoints_and_the_shorthand():
    r = parse_line(json.dumps(chat_line("a", max_completion_tokens=5, top_k=3, seed=1, stop=["x"], temperature=0.7)))
    req = r.request
    assert (r.custom_id, req.chat, req.params.max_tokens, req.params.top_k, req.params.stop) == ("a", True, 5, 3, ["x"])
    assert req.messages == [{"role": "user", "content": "Hi"}]
    req = parse_line(json.dumps(completion_line("b", prompt=[1, 2, 3], n=2, temperature=0.5))).request
    assert (req.chat, req.prompts, req.params.n) == (False, [[1, 2, 3]], 2)
    req = parse_line(json.dumps({"custom_id": "c", "prompt": "hello"})).request
    assert (req.chat, req.prompts, req.params.max_tokens) == (False, ["hello"], 16)


@pytest.mark.parametrize("line, code, has_id", [
    ("{oops", "invalid_json", False),
    (b"\xff\xfe", "invalid_json", False),
    ("[1, 2]", "invalid_json", False),
    (json.dumps({"method": "POST"}), "invalid_custom_id", False),
    (json.dumps({**chat_line("a"), "method": "GET"}), "invalid_method", True),
    (json.dumps({**chat_line("a"), "url": "/v1/images/generations"}), "invalid_url", True),
    (json.dumps({**chat_line("a"), "url": "/v1/embeddings"}), "invalid_request", True),   # a chat body there
    (json.dumps({**chat_line("a"), "body": "x"}), "invalid_request", True),
    (json.dumps(chat_line("a", messages=[])), "invalid_request", True),
    (json.dumps(chat_line("a", temperature="hot")), "invalid_request", True),
    (json.dumps(chat_line("a", top_p=7)), "invalid_request", True),
    (json.dumps(chat_line("a", tools=[{"type": "function"}])), "invalid_request", True),   # no function
    (json.dumps(chat_line("a", functions=[{"name": "f"}])), "unsupported_parameter", True),
    (json.dumps(chat_line("a", stream=True)), "unsupported_parameter", True),
    ('{"custom_id": "a", "prompt": "x", "temperature": NaN}', "invalid_json", False),   # not JSON, as for the server
    (json.dumps(completion_line("a", prompt=None)), "invalid_request", True),
])
def test_parse_line_rejects_malformed_lines(line, code, has_id):
    with pytest.raises(BatchLineError) as e:
        parse_line(line)
    assert e.value.code == code
    assert (e.value.custom_id == "a") == has_id


def test_error_messages_do_not_echo_huge_values():
    with pytest.raises(BatchLineError) as e:
        parse_line(json.dumps(chat_line("a", stop=[""] + ["x" * 100000])))
    assert len(e.value.message) < 400


# ---------------------------------------------------------------------------------------------------
# Runs

def test_batch_chat_completion_and_malformed_lines(tmp_path):
    records = mixed(10) + ["{broken", json.dumps({**chat_line("m1"), "url": "/v1/nope"}), chat_line("c1")]
    src = write_input(tmp_path / "in.jsonl", records)
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, workers=2, model=STORIES, task_size=3, progress=False)
    assert (s["requests"], s["errors"], s["restarts"]) == (13, 3, 0)
    recs = read_output(out)
    ok = {r["custom_id"]: r for r in recs if r["error"] is None}
    assert sorted(ok) == sorted(f"c{i}" if i % 2 else f"p{i}" for i in range(10))
    chat, comp = ok["c1"]["response"], ok["p0"]["response"]
    assert chat["status_code"] == 200 and comp["status_code"] == 200
    assert chat["body"]["object"] == "chat.completion" and chat["body"]["model"] == "tiny"
    assert chat["body"]["choices"][0]["message"]["role"] == "assistant"
    assert comp["body"]["object"] == "text_completion" and isinstance(comp["body"]["choices"][0]["text"], str)
    for r in ok.values():
        u = r["response"]["body"]["usage"]
        assert u["completion_tokens"] == 8 and u["total_tokens"] == u["prompt_tokens"] + 8
        assert r["response"]["body"]["choices"][0]["finish_reason"] == "length"
    errors = [r for r in recs if r["error"] is not None]
    assert sorted(e["error"]["code"] for e in errors) == ["duplicate_custom_id", "invalid_json", "invalid_url"]
    assert all(e["response"] is None for e in errors)
    # Greedy output is what the Python API gives for the same request.
    import corelm
    llm = corelm.LLM(STORIES, threads=1)
    greedy = corelm.SamplingParams(temperature=0, max_tokens=8)
    assert chat["body"]["choices"][0]["message"]["content"] == llm.chat(
        [{"role": "user", "content": "Tell me about 1"}], greedy)[0].outputs[0].text
    assert comp["body"]["choices"][0]["text"] == llm.generate(["Once upon a time 0"], greedy)[0].outputs[0].text


def test_resume_skips_done_ids_and_repairs_a_truncated_last_line(tmp_path):
    src = write_input(tmp_path / "in.jsonl", mixed(8) + ["not json"])
    out = str(tmp_path / "out.jsonl")
    run_batch(src, out, workers=1, model=STORIES, progress=False)
    first = open(out).read()
    s = run_batch(src, out, workers=1, model=STORIES, progress=False)     # nothing left to do
    assert (s["requests"], s["skipped"]) == (0, 9)
    assert open(out).read() == first
    # A crash mid-write: the last three records gone, half of one left without its newline.
    lines = first.splitlines(keepends=True)
    with open(out, "w") as f:
        f.writelines(lines[:-3])
        f.write(lines[-3][: len(lines[-3]) // 2])
    s = run_batch(src, out, workers=2, model=STORIES, progress=False)
    assert s["requests"] == 3
    recs = read_output(out)
    assert sorted(ids_of(recs)) == sorted(f"c{i}" if i % 2 else f"p{i}" for i in range(8))
    assert len(recs) == 9


def _duplicate_input(tmp_path, n=20, dups=8):
    """n lines; the last `dups` repeat earlier ids (and one a malformed line's id), so their error lines
    come after the first lines' results."""
    records = [completion_line(f"d{i}", f"Once upon a time {i}") for i in range(n - dups)]
    records += [completion_line(f"d{i}", "again") for i in range(dups - 1)]
    records.insert(3, json.dumps({**completion_line("bad"), "url": "/v1/nope"}))
    records.append(completion_line("bad"))
    return write_input(tmp_path / "in.jsonl", records), len(records)


def _one_line_per_input_line(out, total):
    recs = read_output(out)
    keys = [r["custom_id"] if r["custom_id"] is not None else r["error"]["line"] for r in recs]
    assert len(keys) == len(set(keys)) == total, keys
    return recs


def test_resume_after_the_first_lines_answered_still_reports_their_duplicates(tmp_path):
    """A rerun used to skip a duplicate line because its id was in the output (from the first line)
    before seeing that it is a duplicate: its error line never appeared."""
    src, total = _duplicate_input(tmp_path)
    out = str(tmp_path / "out.jsonl")
    run_batch(src, out, workers=1, model=STORIES, progress=False)
    recs = _one_line_per_input_line(out, total)
    # as if killed once the first lines were answered, before the duplicates' error lines were written
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs if r["custom_id"] is not None)
    s = run_batch(src, out, workers=1, model=STORIES, progress=False)
    assert (s["requests"], s["errors"]) == (8, 8)
    assert sum(r["error"] is not None and r["error"]["code"] == "duplicate_custom_id" for r in
               _one_line_per_input_line(out, total)) == 8


def test_killed_and_resumed_many_times_every_input_line_gets_exactly_one_output_line(tmp_path):
    """The parent is SIGKILLed at random points (with its workers: the process group), and in each run a
    worker exits abruptly on a random task; rerun until a run completes."""
    import random
    import subprocess
    import sys
    src, total = _duplicate_input(tmp_path, n=30, dups=10)
    out = str(tmp_path / "out.jsonl")
    rng = random.Random(1234)
    cmd = [sys.executable, "-m", "corelm.entrypoints.cli", "batch", STORIES, src, "-o", out, "--no-progress",
           "-t", "1", "-w", "2", "--task-size", "1"]
    def lines():
        try:
            with open(out, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    deadline = time.monotonic() + 60
    kills = 0
    while True:
        env = batch_crash_env(dict(os.environ), **{BATCH_CRASH: f"{rng.choice('01*')}:{rng.randint(1, 4)}"})
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        # kill once this run has written 1-3 more lines (mid-run whatever the machine's speed), 12 times
        target, last = lines() + rng.randint(1, 3), kills >= 12 or time.monotonic() > deadline
        while p.poll() is None and (last or lines() < target):
            time.sleep(0.01)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            kills += 1
            continue
        assert p.returncode == 0
        break
    assert kills >= 3
    recs = _one_line_per_input_line(out, total)
    assert sorted(r["custom_id"] for r in recs if r["error"] is None) == sorted(f"d{i}" for i in range(20))
    assert sum(r["error"] is not None for r in recs) == 11 + sum(
        r["error"] is not None and r["error"]["code"] == "worker_crashed" for r in recs)


def test_a_worker_that_dies_mid_task_has_its_task_redone(tmp_path, monkeypatch):
    batch_crash_env(monkeypatch, **{BATCH_CRASH: "*:1"})  # each first worker exits abruptly on its 1st task
    src = write_input(tmp_path / "in.jsonl", mixed(16))
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, workers=2, model=STORIES, task_size=2, progress=False)
    assert 1 <= s["restarts"] <= 2 and s["errors"] == 0
    ids = ids_of(read_output(out))
    assert len(ids) == len(set(ids)) == 16


def test_sigkill_of_a_worker_loses_and_duplicates_nothing(tmp_path):
    src = write_input(tmp_path / "in.jsonl", [completion_line(f"k{i}", max_tokens=48) for i in range(40)])
    out = str(tmp_path / "out.jsonl")
    killed = []

    def kill(backend):
        pid = backend.pids().get(0)
        if pid:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    s = run_batch(src, out, workers=2, model=STORIES, task_size=2, progress=False,
                  on_start=kill_once_results_flow(out, kill))
    assert killed and s["restarts"] == 1
    ids = ids_of(read_output(out))
    assert sorted(ids) == sorted(f"k{i}" for i in range(40))


def test_engine_options_reach_every_worker(tmp_path):
    """dtype, activations and schedule go to each worker's engine; output matches the API with the same options.
    (int8 is not q8's default. The summary lists every worker that loaded, also one that was ready only
    after the last result: on a busy machine one worker may finish the 24 tiny tasks before the other loads.)"""
    src = write_input(tmp_path / "in.jsonl", mixed(24))
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, workers=2, threads=1, model=STORIES, dtype="q8", activations="int8",
                  schedule="static", task_size=1, progress=False)
    assert (s["requests"], s["errors"], sorted(s["workers"])) == (24, 0, [0, 1])
    import corelm
    llm = corelm.LLM(STORIES, threads=1, dtype="q8", activations="int8", schedule="static")
    for info in s["workers"].values():
        assert (info["dtype"], info["activations"], info["schedule"]) == (llm.engine.dtype, "int8", "static")
    assert llm.engine.dtype.startswith("q8")
    comp = {r["custom_id"]: r for r in read_output(out)}["p0"]["response"]["body"]
    greedy = corelm.SamplingParams(temperature=0, max_tokens=8)
    assert comp["choices"][0]["text"] == llm.generate(["Once upon a time 0"], greedy)[0].outputs[0].text
    for bad in ({"activations": "int4"}, {"schedule": "fast"}):   # refused before any worker starts
        with pytest.raises(ValueError, match="activations|schedule"):
            run_batch(src, str(tmp_path / "o2.jsonl"), model=STORIES, progress=False, **bad)
    assert not os.path.exists(tmp_path / "o2.jsonl")


def test_a_worker_ready_only_at_the_end_is_still_reported():
    """The race behind a summary that listed one of two workers: a worker still loading when the work ran
    out said "ready" after the parent stopped reading. close() now collects that message."""
    backend = ProcessBackend(1, 1, STORIES, {"dtype": "q8", "activations": "int8"})
    late = backend.close()                       # before any wait(): its "ready" was never read
    assert list(late) == [0] and (late[0]["activations"], late[0]["threads"]) == ("int8", 1)


def test_cli_batch_passes_engine_options(tmp_path, monkeypatch):
    got = {}

    def fake_run_batch(*args, **kwargs):
        got.update(kwargs)
        return {"requests": 0, "errors": 0, "skipped": 0, "generated_tokens": 0, "seconds": 0.0, "restarts": 0}
    import corelm.entrypoints.batch
    monkeypatch.setattr(corelm.entrypoints.batch, "run_batch", fake_run_batch)
    src = write_input(tmp_path / "in.jsonl", mixed(1))
    assert cli.main(["batch", src, "-o", str(tmp_path / "o.jsonl"), "--dtype", "q4", "--activations", "int16",
                     "--schedule", "static", "--kv-sparsity", "0.3", "--no-progress"]) == 0
    assert (got["dtype"], got["activations"], got["schedule"]) == ("q4", "int16", "static")
    assert got["kv_sparsity"] == 0.3


def test_every_engine_flag_of_batch_is_a_run_batch_option(tmp_path):
    """Each engine option `corelm batch`'s flags give has a run_batch parameter (--lora, --reasoning-budget and
    --generation-config once had none: a TypeError before any worker started)."""
    import inspect
    from corelm.entrypoints.cli.flags import engine_options
    args = cli.build_parser().parse_args([
        "batch", STORIES, "in.jsonl", "-o", "out.jsonl", "-t", "1", "--dtype", "q4", "-c", "64", "--numa", "isolate",
        "--schedule", "static", "--activations", "int8", "--kv-cache-dtype", "int8", "--kv-cache-gb", "1",
        "--kv-sparsity", "0.3", "--prefix-cache-dir", "d", "--prefix-cache-gb", "1", "--lora", "a=p", "--max-loras",
        "2", "--reasoning-budget", "0", "--generation-config", "vllm", "-tp", "2", "-pp", "2", "--hosts", "h",
        "--mpi-iface", "eth0", "--draft-model", "[ngram]", "--draft-tokens", "3", "--draft-weights", "q8"])
    from corelm.entrypoints.batch import run_batch
    options = engine_options(args)
    assert {"lora_modules", "max_loras", "reasoning_budget", "generation_config"} <= set(options)
    inspect.signature(run_batch).bind("in.jsonl", "out.jsonl", **options)   # TypeError names a missing one


def test_cli_batch(tmp_path, capsys):
    src = write_input(tmp_path / "in.jsonl", mixed(3))
    out = str(tmp_path / "out.jsonl")
    assert cli.main(["batch", src, "-o", out, "-m", STORIES, "--workers", "2", "--no-progress"]) == 0
    assert "3 written (0 errors)" in capsys.readouterr().err
    assert len(read_output(out)) == 3
    assert cli.main(["batch", src, "-o", out, "-m", STORIES, "--workers", "0"]) == 1
    assert "--workers must be at least 1" in capsys.readouterr().err
    assert cli.main(["batch", str(tmp_path / "missing.jsonl"), "-o", out, "-m", STORIES]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["batch", src, "-o", str(tmp_path / "o2.jsonl"), "-m", str(tmp_path / "nope.gguf")]) == 1
    assert "could not load the model" in capsys.readouterr().err


def test_load_done_ignores_garbage_lines(tmp_path):
    p = tmp_path / "out.jsonl"
    p.write_text('{"custom_id": "a"}\nnot json\n{"custom_id": null, "error": {"line": 4}}\n{"custom_id": "b"')
    assert load_done(str(p)) == ({"a"}, {4})
    assert p.read_text().endswith("}}\n")


def test_ray_backend_on_a_local_cluster(tmp_path):
    ray = pytest.importorskip("ray")
    src = write_input(tmp_path / "in.jsonl", mixed(6) + ["{bad"])
    out = str(tmp_path / "out.jsonl")
    try:
        s = run_batch(src, out, workers=2, threads=1, model=STORIES, task_size=2, progress=False,
                      ray_address="local")
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert (s["requests"], s["errors"]) == (7, 1)
    recs = read_output(out)
    assert sorted(ids_of(recs)) == sorted(f"c{i}" if i % 2 else f"p{i}" for i in range(6))


def test_ray_actor_killed_mid_run_has_its_task_redone(tmp_path):
    ray = pytest.importorskip("ray")
    src = write_input(tmp_path / "in.jsonl", [completion_line(f"k{i}", max_tokens=48) for i in range(24)])
    out = str(tmp_path / "out.jsonl")
    killed = []

    def kill(backend):
        ray.kill(backend.actors[0], no_restart=True)
        killed.append(True)

    try:
        s = run_batch(src, out, workers=2, threads=1, model=STORIES, task_size=2, progress=False,
                      ray_address="local", on_start=kill_once_results_flow(out, kill))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert killed and s["restarts"] == 1 and s["errors"] == 0
    assert sorted(ids_of(read_output(out))) == sorted(f"k{i}" for i in range(24))


def _cli_batch(args, **kwargs):
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "batch", STORIES, *args, "--no-progress",
                             "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_ctrl_c_stops_the_run_without_a_traceback_per_worker(tmp_path):
    """SIGINT to the process group, as a terminal sends it: the parent stops the workers and exits 130;
    no KeyboardInterrupt traceback (there used to be one per worker)."""
    src = write_input(tmp_path / "in.jsonl", [completion_line(f"k{i}", max_tokens=200, ignore_eos=True)
                                              for i in range(200)])
    out = str(tmp_path / "out.jsonl")
    # SIGINT at its default in the child: a shell's background job (`.ci/run &`) starts with it ignored
    p = _cli_batch([src, "-o", out, "-w", "2", "--task-size", "1"], start_new_session=True,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not (os.path.exists(out) and os.path.getsize(out) > 0):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    read_output(out)                             # whole lines only


def test_output_to_a_device_and_input_from_a_device(tmp_path):
    """-o /dev/full: not read back (it used to be read until MemoryError); the write fails with a clear error.
    IN /dev/null: an empty input, not "does not exist"."""
    src = write_input(tmp_path / "in.jsonl", mixed(2))
    p = _cli_batch([src, "-o", "/dev/full"])
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "Traceback" not in err and "No space left on device" in err, err
    out = str(tmp_path / "out.jsonl")
    p = _cli_batch(["/dev/null", "-o", out])
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "0 written" in err, err
    assert load_done("/dev/full") == (set(), set())
    p = _cli_batch([str(tmp_path), "-o", out])
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "is a directory" in err, err
