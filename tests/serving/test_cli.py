"""The `corelm` command line, driven in-process with a fake engine (and once for real when built)."""
import argparse
import ast
import builtins
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import types

import pytest

from corelm import options
from corelm.entrypoints import cli
from corelm.loader.spec import LoadedModel, ModelLoadError, ModelSpec
from corelm.engine.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests", "data", "models", "stories260K")


class FakeLLM:
    """Answers call number k with 'reply k' in three chunks; can raise mid-answer."""

    def __init__(self, interrupt_on=None, error_on=None, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        self.resets = 0
        self.max_seq_len = 2048
        self.last_metrics = {}
        self.interrupt_on = interrupt_on or {}    # call number -> chunks to yield before Ctrl-C
        self.error_on = error_on or set()          # call numbers whose chat_stream raises ValueError
        self.closed = 0

    def chat_stream(self, messages, params):
        self.calls.append(("chat", [dict(m) for m in messages], params))
        if len(self.calls) in self.error_on:
            raise ValueError("the prompt has 9999 tokens, but the context holds 2048")
        return self._reply()

    def stream(self, prompt, params):
        self.calls.append(("stream", prompt, params))
        return self._reply()

    def reset(self):
        self.resets += 1

    def _reply(self):
        k = len(self.calls)
        chunks = ["reply", " ", str(k)]
        try:
            for i, text in enumerate(chunks):
                if self.interrupt_on.get(k) == i:
                    raise KeyboardInterrupt
                yield types.SimpleNamespace(text=text, token_id=i, finish_reason=None)
            yield types.SimpleNamespace(text="", token_id=None, finish_reason="stop")
        except GeneratorExit:
            self.closed += 1
            raise
        finally:
            self.last_metrics = {"prompt_tokens": 5, "prompt_time_s": 0.1,
                                 "generated_tokens": 3, "generation_time_s": 0.1}


@pytest.fixture
def fake(monkeypatch):
    """Installs a FakeLLM factory; the test can set attributes on `fake.options` before running."""
    state = types.SimpleNamespace(llm=None, options={})

    def factory(**kwargs):
        state.llm = FakeLLM(**state.options, **kwargs)
        return state.llm
    monkeypatch.setattr(cli.flags, "_make_llm", factory)
    return state


def run_chat(monkeypatch, stdin_text, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin_text))
    return cli.main(["chat", *args])


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# --------------------------------------------------------------------------------------------------
# chat

def test_chat_piped_answers_each_line_and_keeps_history(monkeypatch, capsys, fake):
    assert run_chat(monkeypatch, "hi\n\nhow are you\n") == 0
    out, err = capsys.readouterr()
    assert out == "reply 1\nreply 2\n"
    assert ">>>" not in out and err == ""
    assert [c[1] for c in fake.llm.calls] == [[user("hi")],
                                              [user("hi"), assistant("reply 1"), user("how are you")]]


def test_chat_and_generate_with_stdin_closed(monkeypatch, capsys, fake):
    """`corelm chat <&-`: Python's sys.stdin is None; a clear error, not an AttributeError traceback."""
    monkeypatch.setattr(sys, "stdin", None)
    assert cli.main(["chat"]) == 1
    assert capsys.readouterr().err == "error: stdin is closed: corelm chat reads the messages from it.\n"
    assert fake.llm is None                         # refused before loading the model
    assert cli.main(["generate"]) == 1
    assert capsys.readouterr().err.startswith("error: no prompt")


def test_chat_flags_reach_the_engine_and_sampling_params(monkeypatch, fake):
    run_chat(monkeypatch, "hi\n", "some/model", "-t", "3", "--dtype", "bf16", "-c", "512", "--temp", "0.5",
             "--top-k", "10", "--seed", "7", "-n", "32", "--system", "Be brief.")
    llm = fake.llm
    assert llm.kwargs == dict(model="some/model", threads=3, dtype="bf16", max_seq_len=512, numa=None)
    _, messages, params = llm.calls[0]
    assert messages == [{"role": "system", "content": "Be brief."}, user("hi")]
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.5, 10, 0.95, 0.05)
    assert (params.seed, params.max_tokens) == (7, 32)


def test_activations_flag_reaches_the_engine(monkeypatch, fake):
    run_chat(monkeypatch, "hi\n", "--dtype", "q8", "--activations", "int16")
    assert fake.llm.kwargs["activations"] == "int16" and fake.llm.kwargs["dtype"] == "q8"


def test_kv_sparsity_flag_reaches_the_engine(monkeypatch, fake):
    run_chat(monkeypatch, "hi\n", "--kv-cache-dtype", "int8", "--kv-sparsity", "0.5")
    assert fake.llm.kwargs["kv_sparsity"] == 0.5 and fake.llm.kwargs["kv_cache_dtype"] == "int8"


def test_chat_defaults_follow_llama_cli(monkeypatch, fake):
    run_chat(monkeypatch, "hi\n")
    assert fake.llm.kwargs == dict(model=None, threads=None, dtype="auto", max_seq_len=None, numa=None)
    params = fake.llm.calls[0][2]
    assert params.seed is None and params.max_tokens is None and params.repetition_penalty == 1.0


def test_clear_resets_history_and_kv_cache_but_keeps_the_system_message(monkeypatch, capsys, fake):
    run_chat(monkeypatch, "hi\n/clear\nagain\n", "--system", "S")
    assert fake.llm.resets == 1
    assert fake.llm.calls[1][1] == [{"role": "system", "content": "S"}, user("again")]
    assert "Cleared" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["/exit", "/bye"])
def test_exit_commands_stop_the_loop(monkeypatch, fake, command):
    assert run_chat(monkeypatch, f"hi\n{command}\nnever answered\n") == 0
    assert len(fake.llm.calls) == 1


@pytest.mark.parametrize("command", ["/help", "/?"])
def test_help_lists_the_commands(monkeypatch, capsys, fake, command):
    run_chat(monkeypatch, command + "\n")
    out = capsys.readouterr().out
    for name in ("/clear", "/exit", "/bye", "/stats", "/set system", '"""'):
        assert name in out
    assert fake.llm.calls == []


def test_unknown_command_is_reported_not_sent(monkeypatch, capsys, fake):
    run_chat(monkeypatch, "/frobnicate\n")
    assert "Unknown command '/frobnicate'" in capsys.readouterr().out
    assert fake.llm.calls == []


def test_set_system_replaces_the_system_message(monkeypatch, fake):
    run_chat(monkeypatch, "hi\n/set system Talk like a pirate.\nagain\n", "--system", "old")
    assert fake.llm.calls[1][1] == [{"role": "system", "content": "Talk like a pirate."},
                                    user("hi"), assistant("reply 1"), user("again")]


def test_verbose_prints_the_stats_line(monkeypatch, capsys, fake):
    run_chat(monkeypatch, "hi\n", "--verbose")
    err = capsys.readouterr().err
    assert "prompt: 5 tokens, 50.0 tok/s | generation: 3 tokens, 30.0 tok/s" in err


def test_stats_command_toggles_the_stats_line(monkeypatch, capsys, fake):
    run_chat(monkeypatch, "one\n/stats\ntwo\n/stats\nthree\n")
    assert capsys.readouterr().err.count("generation: 3 tokens") == 1


def test_multi_line_message(monkeypatch, fake):
    run_chat(monkeypatch, '"""first line\nsecond line\nlast"""\n"""one-liner"""\n')
    assert fake.llm.calls[0][1] == [user("first line\nsecond line\nlast")]
    assert fake.llm.calls[1][1][-1] == user("one-liner")


def test_ctrl_c_mid_answer_keeps_the_partial_answer_and_continues(monkeypatch, capsys, fake):
    fake.options = dict(interrupt_on={1: 1})           # first answer: Ctrl-C after "reply"
    assert run_chat(monkeypatch, "hi\nagain\n") == 0
    assert capsys.readouterr().out == "reply\nreply 2\n"
    assert fake.llm.calls[1][1] == [user("hi"), assistant("reply"), user("again")]


def test_ctrl_c_before_any_text_drops_the_question(monkeypatch, fake):
    fake.options = dict(interrupt_on={1: 0})
    run_chat(monkeypatch, "hi\nagain\n")
    assert fake.llm.calls[1][1] == [user("again")]


def test_ctrl_c_in_the_consumer_closes_the_engine_stream(monkeypatch, fake):
    """A real Ctrl-C lands in the REPL's code, not the engine's: the stream must be closed."""
    real_write = sys.stdout.write
    calls = {"n": 0}

    def write(text):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_write(text)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    monkeypatch.setattr(sys.stdout, "write", write)
    assert cli.main(["chat"]) == 0
    assert fake.llm.closed == 1


def test_error_during_a_turn_is_reported_and_the_chat_goes_on(monkeypatch, capsys, fake):
    fake.options = dict(error_on={1})
    assert run_chat(monkeypatch, "too long\nshort\n") == 1      # piped: the failure shows in the status
    out, err = capsys.readouterr()
    assert "error: the prompt has 9999 tokens" in err and "Traceback" not in err
    assert out == "reply 2\n"
    assert fake.llm.calls[1][1] == [user("short")]


def test_interactive_ctrl_c_at_the_prompt_hints_then_second_one_exits(monkeypatch, capsys):
    inputs = iter([KeyboardInterrupt, "hi", KeyboardInterrupt, KeyboardInterrupt, "never"])

    def fake_input(prompt):
        item = next(inputs)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item
    monkeypatch.setattr(builtins, "input", fake_input)
    llm = FakeLLM()
    repl = cli.chat.ChatREPL(llm, SamplingParams(), interactive=True)
    assert repl.run() == 0
    out = capsys.readouterr().out
    assert out.count("Use /exit or Ctrl-D to quit") == 2
    assert "reply 1" in out and len(llm.calls) == 1


def test_interactive_eof_exits_cleanly(monkeypatch, capsys):
    def eof(prompt):
        raise EOFError
    monkeypatch.setattr(builtins, "input", eof)
    assert cli.chat.ChatREPL(FakeLLM(), SamplingParams(), interactive=True).run() == 0


# --------------------------------------------------------------------------------------------------
# errors

@pytest.mark.parametrize("argv, message", [
    (["chat", "--temp", "-1"], "error: temperature must be non-negative, got -1.0."),
    (["generate", "-p", "x", "--top-p", "1.5"], "error: top_p must be in (0, 1], got 1.5."),
    (["generate", "-p", "x", "--temp", "nan"], "error: temperature must be a finite number"),
    (["generate", "-p", "x", "-n", "0"], "error: max_tokens must be at least 1, got 0."),
    (["chat", "--threads", "0"], "error: --threads must be at least 1, got 0."),
    (["chat", "--kv-sparsity", "1"], "error: --kv-sparsity must be in [0, 1), got 1.0."),
    (["generate", "-p", "x", "--kv-sparsity", "-0.5"], "error: --kv-sparsity must be in [0, 1), got -0.5."),
])
def test_bad_flag_values_exit_1_with_an_error_line(capsys, fake, argv, message):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert fake.llm is None                          # rejected before loading the model


@pytest.mark.parametrize("exc", [ModelLoadError("x.gguf: not a GGUF file (bad magic)"),
                                 FileNotFoundError("no such model: x.gguf")])
def test_model_errors_exit_1(monkeypatch, capsys, exc):
    def factory(**kwargs):
        raise exc
    monkeypatch.setattr(cli.flags, "_make_llm", factory)
    assert cli.main(["generate", "x.gguf", "-p", "hi"]) == 1
    assert capsys.readouterr().err == f"error: {exc}\n"


def test_argparse_errors_return_2(capsys):
    assert cli.main(["generate", "--temp", "hot"]) == 2
    assert "invalid float value" in capsys.readouterr().err
    assert cli.main([]) == 2


def test_no_traceback_from_the_installed_entry_point():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "corelm.entrypoints.cli", "chat", "--temp", "-1"], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == "error: temperature must be non-negative, got -1.0.\n"


# --------------------------------------------------------------------------------------------------
# generate

def test_generate_prints_the_completion(capsys, fake):
    assert cli.main(["generate", "-p", "Once upon a time", "-n", "5", "--temp", "0"]) == 0
    assert capsys.readouterr().out == "reply 1\n"
    kind, prompt, params = fake.llm.calls[0]
    assert (kind, prompt, params.max_tokens, params.is_greedy) == ("stream", "Once upon a time", 5, True)


def test_generate_no_stream_and_verbose(capsys, fake):
    assert cli.main(["generate", "-p", "x", "--no-stream", "-v"]) == 0
    out, err = capsys.readouterr()
    assert out == "reply 1\n" and "generation: 3 tokens" in err


def test_generate_chat_wraps_the_prompt_as_a_user_message(capsys, fake):
    cli.main(["generate", "-p", "hi", "--chat"])
    assert fake.llm.calls[0][:2] == ("chat", [user("hi")])
    cli.main(["generate", "-p", "hi", "--system", "S"])
    assert fake.llm.calls[0][:2] == ("chat", [{"role": "system", "content": "S"}, user("hi")])


def test_generate_reads_the_prompt_from_stdin_or_a_file(monkeypatch, tmp_path, fake):
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    cli.main(["generate"])
    assert fake.llm.calls[0][1] == "from stdin"
    path = tmp_path / "prompt.txt"
    path.write_text("from a file", encoding="utf-8")
    cli.main(["generate", "-f", str(path)])
    assert fake.llm.calls[0][1] == "from a file"


def test_generate_ctrl_c_closes_the_stream(capsys, fake):
    fake.options = dict(interrupt_on={1: 1})
    assert cli.main(["generate", "-p", "x"]) == 130
    assert capsys.readouterr().out == "reply\n"


# --------------------------------------------------------------------------------------------------
# info

def test_info_json_has_cpu_and_features(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"cpu", "features", "kernels", "memory"} <= set(info)
    assert info["cpu"]["logical_cores"] >= 1 and info["cpu"]["numa_nodes"] >= 1
    assert isinstance(info["features"], list)
    if info["features_source"] == "corelm._core":
        assert isinstance(info["kernels"], dict) and info["kernels"]
    else:
        assert info["kernels"] is None and "core_error" in info


def test_info_reports_the_cores_kernels(monkeypatch, capsys):
    core = types.SimpleNamespace(cpu_info=lambda: {"brand": "Test CPU", "features": ["avx2", "fma"],
                                                   "kernels": {"matmul_fp32": "avx2"}, "bf16_native": False})
    monkeypatch.setitem(sys.modules, "corelm._core", core)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "Test CPU" in out and "avx2 fma" in out and "matmul_fp32=avx2" in out


def test_info_without_the_core_still_works(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "corelm._core", None)       # import raises ImportError
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kernels"] is None and info["features_source"] == "/proc/cpuinfo"


def test_info_with_a_model_shows_its_spec(monkeypatch, capsys):
    import corelm.loader
    spec = ModelSpec(arch="llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=True)
    loaded = LoadedModel(spec=spec, get_weight=None, tokenizer=None, source="/m", source_format="gguf",
                         description="GGUF F32")
    monkeypatch.setattr(corelm.loader, "load_model", lambda path: loaded, raising=False)
    assert cli.main(["info", "/m", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    # embeddings 100*8 + norm 8 + per layer (2 norms 16, wq 64, wk 32, wv 32, wo 64, 3 * ffn 128)
    assert model["parameters"] == 800 + 8 + 2 * (16 + 64 + 32 + 32 + 64 + 3 * 128)
    assert (model["architecture"], model["layers"], model["vocab_size"], model["format"]) == ("llama", 2, 100, "gguf")


def test_info_with_a_missing_model_is_a_user_error(capsys):
    assert cli.main(["info", "/nonexistent/model.gguf"]) == 1
    assert capsys.readouterr().err.startswith("error: ")


# --------------------------------------------------------------------------------------------------
# the real engine, end to end

def test_generate_with_the_real_engine(capsys):
    argv = ["generate", STORIES, "-p", "Once upon a time", "-n", "8", "--temp", "0"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert cli.main(argv + ["--no-stream"]) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_chat_drops_oldest_turns_when_the_context_fills(monkeypatch, capsys):
    """A long conversation with the real engine in a tiny context keeps answering."""
    text = "Lily and Tom went to the park to play with a big red ball and a little dog. " * 2
    stdin = "\n".join([text] * 5) + "\n"
    assert run_chat(monkeypatch, stdin, STORIES, "-c", "160", "-n", "24", "--temp", "0", "--dtype", "fp32") == 0
    out, err = capsys.readouterr()
    assert "dropped the" in err and "error:" not in err
    assert len([line for line in out.splitlines() if line.strip()]) == 5


# --------------------------------------------------------------------------------------------------
# batch: MODEL first, as for every command

@pytest.fixture
def fake_batch(monkeypatch):
    """Replaces corelm.entrypoints.batch.run_batch; returns what it was called with."""
    import corelm.entrypoints.batch
    seen = {}

    def run_batch(input_path, output_path, **kwargs):
        seen.clear()
        seen.update(kwargs, input=input_path, output=output_path)
        return dict(requests=0, errors=0, skipped=0, generated_tokens=0, seconds=0.0, restarts=0)
    monkeypatch.setattr(corelm.entrypoints.batch, "run_batch", run_batch)
    return seen


def test_batch_takes_the_model_first_and_in_jsonl_alone(capsys, fake_batch):
    assert cli.main(["batch", "m.gguf", "in.jsonl", "-o", "out.jsonl", "-w", "2", "--numa", "isolate"]) == 0
    assert (fake_batch["model"], fake_batch["input"], fake_batch["output"]) == ("m.gguf", "in.jsonl", "out.jsonl")
    assert (fake_batch["workers"], fake_batch["numa"]) == (2, "isolate")
    assert cli.main(["batch", "in.jsonl", "-o", "out.jsonl"]) == 0          # no MODEL: the embedded one
    assert (fake_batch["model"], fake_batch["input"]) == (None, "in.jsonl")
    assert "deprecated" not in capsys.readouterr().err


def test_batch_still_takes_the_deprecated_model_flag(capsys, fake_batch):
    assert cli.main(["batch", "in.jsonl", "-o", "out.jsonl", "-m", "old.gguf"]) == 0
    assert (fake_batch["model"], fake_batch["input"]) == ("old.gguf", "in.jsonl")
    assert "-m/--model is deprecated" in capsys.readouterr().err
    assert cli.main(["batch", "m.gguf", "in.jsonl", "-o", "out.jsonl", "--model", "old.gguf"]) == 1
    assert "two models" in capsys.readouterr().err


def test_batch_needs_in_jsonl_and_out(capsys, fake_batch):
    assert cli.main(["batch", "-o", "out.jsonl"]) == 2
    assert cli.main(["batch", "in.jsonl"]) == 2
    assert not fake_batch


# --------------------------------------------------------------------------------------------------
# one vocabulary: every command's option values come from corelm.options

# The commands and the registry options their flags take.
CHOICE_FLAGS = {"chat": {"--dtype": "dtype", "--activations": "activations", "--schedule": "schedule",
                         "--numa": "numa"},
                "info": {"--numa": "numa"},
                "convert": {"--weights": "weights"}, "pull": {}, "list": {}}
for _command in ("generate", "serve", "batch"):
    CHOICE_FLAGS[_command] = CHOICE_FLAGS["chat"]


def command_parsers():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices


def choice_actions(parser):
    """{flag: action} for the flags that take a registry option's values."""
    names = {"--dtype", "--activations", "--schedule", "--numa", "--weights"}
    return {flag: a for a in parser._actions for flag in a.option_strings if flag in names}


def test_every_commands_choices_and_help_come_from_the_options_registry():
    parsers = command_parsers()
    assert set(parsers) == set(CHOICE_FLAGS)
    for command, parser in parsers.items():
        actions = choice_actions(parser)
        assert {flag: a.dest for flag, a in actions.items()} == CHOICE_FLAGS[command]
        for flag, option in CHOICE_FLAGS[command].items():
            assert tuple(actions[flag].choices) == options.argparse_choices(option), (command, flag)
            assert options.CHOICES[option].help in actions[flag].help, (command, flag)


def test_a_name_added_to_the_registry_reaches_every_command(monkeypatch):
    for option in ("dtype", "activations", "schedule", "numa", "weights"):
        c = options.CHOICES[option]
        monkeypatch.setitem(options.CHOICES, option, dataclasses.replace(c, values=c.values + ("newname",)))
    for command, parser in command_parsers().items():
        for flag, action in choice_actions(parser).items():
            assert "newname" in action.choices, (command, flag)


def test_the_command_line_never_reaches_past_the_engine():
    """Entry points use the engine layer: no corelm._core import, no sysfs or /proc path of their own."""
    folder = os.path.dirname(cli.__file__)
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".py")):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""] + [a.name for a in node.names]
            else:
                modules = []
            assert not any(m.split(".")[-1] == "_core" for m in modules), f"{name} imports _core"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not any(s in node.value for s in ("corelm._core", "/sys/", "/proc/")), f"{name}: {node.value!r}"


def test_the_installed_command_is_this_main():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        target = re.search(r'^corelm = "(.+)"$', f.read(), re.M).group(1)   # [project.scripts]
    module, _, attr = target.partition(":")
    assert getattr(importlib.import_module(module), attr) is cli.main


@pytest.mark.parametrize("model", ["tests/data/models/stories260K/stories260K.gguf",
                                   "models/SmolLM2-135M-Instruct.Q4_1.gguf"])
def test_info_reports_the_context_and_storage_the_engine_uses(model, capsys):
    """`corelm info MODEL` says the context chat/serve/batch get by default (the model's trained 8192 for the
    embedded one) and how the matrices are stored (the embedded GGUF keeps its
    q4_1 and q8_0 blocks: it used to be described only as "dequantized to fp32 at load")."""
    import corelm
    path = os.path.join(ROOT, model)
    llm = corelm.LLM(path, threads=1)
    assert cli.main(["info", path]) == 0
    out = capsys.readouterr().out
    assert f"context {llm.engine.max_seq_len} (-c 0" in out
    assert f"Weights:   matrices stored as {llm.engine.dtype} (--dtype auto)" in out
    assert f"take {llm.engine.activations} activations (--activations auto: the exact path" in out
    assert "dequantized" not in out          # the GGUF's blocks are kept as stored
    bf16 = corelm.LLM(path, threads=1, kv_cache_dtype="bf16", kv_sparsity=0.5).engine.core  # the pool's own size
    per_token = bf16.kv_bytes // (bf16.kv_blocks * bf16.kv_block_size)
    assert "at --kv-sparsity 0.5 fp32 " in out and f", bf16 {per_token}, int8" in out.split("at --kv-sparsity 0.5")[1]
