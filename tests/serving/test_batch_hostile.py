"""`corelm batch` against input and surroundings that used to lose data (issue 50), on stories260K.

An output that is the input, an output deleted or replaced mid-run, one bad request failing its
neighbours (a lone surrogate, a tokenizer regex that panics, a request that kills its worker), lines that
aborted the whole run (JSON nested 100k deep, a surrogate custom_id, a forced tool call over the schema
size limit), and workers orphaned by a SIGKILLed parent printing BrokenPipeError tracebacks."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import BATCH_CRASH_ON, MODELS, batch_crash_env, child_env
from corelm.entrypoints import cli
from corelm.entrypoints.batch import BatchLineError, parse_line, run_batch
from corelm.entrypoints.batch.protocol import error_line
from corelm.entrypoints.batch.runner import OutputLostError, _Writer
from corelm.entrypoints.batch.worker import BatchWorker

STORIES = os.path.join(MODELS, "stories260K")
SURROGATE_LINE = '{"custom_id": "bad", "messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 4}'


def completion(cid, prompt="Once upon a time", **body):
    return json.dumps({"custom_id": cid, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body})


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def read_output(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]      # every line valid JSON


def by_id(recs):
    return {r["custom_id"]: r for r in recs if r["custom_id"] is not None}


def cli_batch(args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "corelm.entrypoints.cli", "batch", STORIES, *args, "--no-progress",
                             "-t", "1"], env=child_env(), text=True, **kwargs)


def wait_for_output(out, p=None, timeout=60):
    deadline = time.monotonic() + timeout
    while not (os.path.exists(out) and os.path.getsize(out) > 0):
        assert time.monotonic() < deadline and (p is None or p.poll() is None), "no result line appeared"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------
# The output file

@pytest.mark.parametrize("how", ["same path", "symlink", "hard link"])
def test_an_output_that_is_the_input_is_refused_before_anything_is_written(tmp_path, capsys, how):
    """`corelm batch same.jsonl -o same.jsonl` appended its results to the file it was reading, forever."""
    src = write_lines(tmp_path / "same.jsonl", [completion("a"), completion("b")])
    before = open(src, "rb").read()
    out = {"same path": src, "symlink": str(tmp_path / "link.jsonl"), "hard link": str(tmp_path / "hard.jsonl")}[how]
    if how == "symlink":
        os.symlink(src, out)
    elif how == "hard link":
        os.link(src, out)
    assert cli.main(["batch", STORIES, src, "-o", out, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "is the input file" in err and out in err, err
    assert open(src, "rb").read() == before


def test_an_output_deleted_mid_run_is_an_error_not_a_success(tmp_path):
    """The run used to exit 0 with "N written ... -> del.out" though del.out was gone."""
    src = write_lines(tmp_path / "in.jsonl", [completion(f"k{i}", max_tokens=32) for i in range(400)])
    out = str(tmp_path / "del.out")
    p = cli_batch([src, "-o", out, "--task-size", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_output(out, p)
        os.remove(out)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0, err
    assert f"the output file {out} was deleted" in err and " written (" not in err, err
    assert "Traceback" not in err, err


def test_an_output_replaced_mid_run_is_an_error(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [completion(f"k{i}", max_tokens=32) for i in range(300)])
    out = str(tmp_path / "out.jsonl")

    def replace_once_results_flow(backend):
        def go():
            wait_for_output(out)
            other = tmp_path / "other.jsonl"
            other.write_text("")
            os.replace(other, out)
        threading.Thread(target=go, daemon=True).start()

    with pytest.raises(OutputLostError, match="was replaced"):
        run_batch(src, out, model=STORIES, threads=1, task_size=2, progress=False, on_start=replace_once_results_flow)


def test_a_custom_id_that_cannot_be_encoded_still_gives_a_valid_line(tmp_path):
    """The writer's last line of defence: a lone surrogate is written as a JSON escape, not a UnicodeEncodeError."""
    out = tmp_path / "out.jsonl"
    w = _Writer(str(out), set())
    w.write(error_line("\ud800bad", "invalid_request", "x"))
    w.close()
    assert read_output(out)[0]["custom_id"] == "\ud800bad"


# ---------------------------------------------------------------------------------------------------
# One bad request fails alone

def test_a_lone_surrogate_is_refused_at_parse_time(tmp_path):
    """It used to reach the worker, whose tokenizer raised TypeError and killed it; after 3 deaths every
    request of its task, valid ones included, was written as worker_crashed (and never retried)."""
    with pytest.raises(BatchLineError) as e:
        parse_line(SURROGATE_LINE)
    assert (e.value.code, e.value.custom_id) == ("invalid_request", "bad") and "surrogate" in e.value.message
    ok = parse_line('{"custom_id": "pair", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')   # a pair is text
    assert ok.request.prompts == ["smile \U0001F600"]
    src = write_lines(tmp_path / "in.jsonl", [completion("a0"), completion("a1"), SURROGATE_LINE, completion("a2")])
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, model=STORIES, threads=1, progress=False)
    recs = by_id(read_output(out))
    assert (s["requests"], s["errors"], s["restarts"]) == (4, 1, 0)
    assert recs["bad"]["error"]["code"] == "invalid_request"
    assert all(recs[c]["error"] is None for c in ("a0", "a1", "a2"))


def test_a_request_the_parser_let_through_fails_alone_in_the_worker():
    """The worker's own guard: a request whose tokenization raises gets its own error line."""
    bad = parse_line(completion("bad"))
    bad.request.prompts = ["hi \ud800 there"]
    worker = BatchWorker(STORIES, 1)
    results = {rec["custom_id"]: rec for rec, _ in worker.run_task([parse_line(completion("a")), bad,
                                                                     parse_line(completion("b"))])}
    assert results["bad"]["error"]["code"] == "internal_error" and "TypeError" in results["bad"]["error"]["message"]
    assert results["a"]["error"] is None and results["b"]["error"] is None


def test_a_tokenizer_panic_fails_only_its_request(tmp_path):
    """A pre-tokenizer Split regex that backtracks catastrophically makes the tokenizers crate panic
    (pyo3 PanicException, a BaseException): it used to kill the worker, 3 times, and fail the whole task."""
    model = tmp_path / "backtracking"
    model.mkdir()
    for f in ("config.json", "generation_config.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(STORIES, f), model / f)
    tok = json.load(open(os.path.join(STORIES, "tokenizer.json")))
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False},
        tok["pre_tokenizer"]]}
    (model / "tokenizer.json").write_text(json.dumps(tok))
    lines = [completion(f"a{i}") for i in range(5)]
    lines.insert(2, completion("panic", prompt="a" * 40 + "b"))
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, model=str(model), threads=1, task_size=8, progress=False)
    recs = by_id(read_output(out))
    assert (s["requests"], s["errors"], s["restarts"]) == (6, 1, 0)
    assert recs["panic"]["error"]["code"] == "internal_error" and "PanicException" in recs["panic"]["error"]["message"]
    assert all(recs[f"a{i}"]["error"] is None for i in range(5))


def test_a_request_that_kills_its_worker_takes_no_neighbour_down(tmp_path, monkeypatch):
    """A crash the worker cannot catch (native code, the OOM killer): the task is retried one request at a
    time, so only the request that kills the worker is written as worker_crashed."""
    batch_crash_env(monkeypatch, **{BATCH_CRASH_ON: "p3"})
    src = write_lines(tmp_path / "in.jsonl", [completion(f"p{i}") for i in range(8)])
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, model=STORIES, threads=1, task_size=8, progress=False)
    recs = by_id(read_output(out))
    assert (s["requests"], s["errors"], s["restarts"]) == (8, 1, 3)
    assert recs["p3"]["error"]["code"] == "worker_crashed"
    assert all(recs[f"p{i}"]["error"] is None for i in range(8) if i != 3)


# ---------------------------------------------------------------------------------------------------
# A bad line is that line's error line, never the whole file's

def _deep_schema(depth):
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"x": s}}
    return s


def test_lines_that_aborted_the_parent_are_each_their_own_error_line(tmp_path):
    """Each of these made the parent abort before writing anything: RecursionError in json.loads, a
    UnicodeEncodeError writing the error line of a surrogate custom_id, and a ValueError raised past the
    request checks ("structured_outputs.json is longer than 65536 characters")."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _deep_schema(40)}} for i in range(100)]
    lines = [completion("ok0"),
             "[" * 100000 + "]" * 100000,
             '{"custom_id": "\\ud800bad", "prompt": "x", "max_tokens": 2}',
             json.dumps({"custom_id": "tools", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                         "tool_choice": "required"}),
             completion("ok1")]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    s = run_batch(src, out, model=STORIES, threads=1, progress=False)
    assert (s["requests"], s["errors"]) == (5, 3)
    recs = read_output(out)
    by_line = {r["error"]["line"]: r["error"] for r in recs if r["custom_id"] is None}
    assert by_line[2]["code"] == "invalid_json" and "deeply" in by_line[2]["message"]
    assert by_line[3]["code"] == "invalid_custom_id"
    assert by_id(recs)["tools"]["error"]["code"] == "invalid_request"
    assert "65536" in by_id(recs)["tools"]["error"]["message"]
    assert by_id(recs)["ok0"]["error"] is None and by_id(recs)["ok1"]["error"] is None
    s = run_batch(src, out, model=STORIES, threads=1, progress=False)      # a resume finds every line done
    assert (s["requests"], s["skipped"]) == (0, 5)


# ---------------------------------------------------------------------------------------------------
# Orphans

def test_workers_of_a_sigkilled_parent_exit_promptly_and_quietly(tmp_path):
    """They used to finish their task for nobody and print a BrokenPipeError traceback each."""
    src = write_lines(tmp_path / "in.jsonl", [completion(f"k{i}", max_tokens=200, ignore_eos=True)
                                              for i in range(400)])
    out = str(tmp_path / "out.jsonl")
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        p = cli_batch([src, "-o", out, "-w", "2", "--task-size", "1"], stdout=subprocess.DEVNULL, stderr=err,
                      start_new_session=True)
    try:
        wait_for_output(out, p)
        children = psutil.Process(p.pid).children()      # the workers (and multiprocessing's resource tracker)
        assert sum("spawn_main" in " ".join(c.cmdline()) for c in children) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"workers still running 5 s after their parent died: {alive}"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = err_path.read_text()
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
