"""LoRA adapters in batch files (corelm batch MODEL IN.jsonl --lora NAME=PATH): a line whose model is an adapter's
name gets what LLM.generate gives with that LoRARequest, a line naming the base model (or no model) the base
model's output; with --models-dir, --lora is refused."""
import json

import pytest

from corelm import SamplingParams
from corelm.entrypoints import cli
from test_batch_cli import completion_line, read_output, write_input
from test_lora import STORIES, random_adapter, write_peft

PROMPTS = ["Once upon a time", "The little dog"]


def test_a_lines_model_selects_the_adapter(tmp_path, capsys):
    import corelm
    from corelm.entrypoints.cli.flags import lora_modules
    path = write_peft(tmp_path / "one", random_adapter(8, 1), 8, 16)
    loras = lora_modules([f"tuned={path}:0.5"])
    ref = corelm.LLM(STORIES, dtype="fp32", threads=1, speculative_model=None, lora_modules=loras)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = {(model, p): ref.generate(p, greedy, lora_request=lora)[0].outputs[0].text
            for model, lora in (("tuned", loras[0]), ("base", None)) for p in PROMPTS}
    assert all(want["tuned", p] != want["base", p] for p in PROMPTS)   # the adapter changes the output
    base_name = ref.engine.model_name
    lines = []
    for i, p in enumerate(PROMPTS):
        lines += [completion_line(f"t{i}", p, model="tuned", max_tokens=16, ignore_eos=True),
                  completion_line(f"b{i}", p, model=base_name, max_tokens=16, ignore_eos=True),
                  completion_line(f"n{i}", p, max_tokens=16, ignore_eos=True)]
    src = write_input(tmp_path / "in.jsonl", lines)
    out = str(tmp_path / "out.jsonl")
    # task size 8: each task mixes the adapter's lines and the base model's in one engine
    assert cli.main(["batch", STORIES, src, "-o", out, "--lora", f"tuned={path}:0.5", "--dtype", "fp32", "-t", "1",
                     "--no-progress"]) == 0, capsys.readouterr().err
    got = {r["custom_id"]: r["response"]["body"] for r in read_output(out)}
    assert sorted(got) == sorted(r["custom_id"] for r in lines)
    for i, p in enumerate(PROMPTS):
        for cid, model, answered_as in ((f"t{i}", "tuned", "tuned"), (f"b{i}", "base", base_name),
                                        (f"n{i}", "base", base_name)):
            assert got[cid]["choices"][0]["text"] == want[model, p], cid
            assert got[cid]["model"] == answered_as


def test_lora_is_refused_with_models_dir(tmp_path, capsys):
    path = write_peft(tmp_path / "one", random_adapter(8, 1), 8, 16)
    src = write_input(tmp_path / "in.jsonl", [json.dumps(completion_line("a"))])
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "stories").symlink_to(STORIES)
    assert cli.main(["batch", src, "-o", str(tmp_path / "out.jsonl"), "--models-dir", str(tmp_path / "models"),
                     "--lora", f"tuned={path}", "--no-progress"]) == 1
    assert "--lora" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
