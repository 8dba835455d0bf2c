#!/usr/bin/env python3
"""Chat templates of real models rendered by transformers, for tests/test_chat_template.py to render the
same conversations with corelm's sandbox and compare text. The templates are llama.cpp's copies of the
hub repos' (models/templates/, MIT), kept in tests/data/templates/.

    /work/venv-torch/bin/python tools/make_template_fixtures.py     # writes tests/data/fixtures/templates_real.json
"""
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = os.path.join(REPO, "tests", "data", "templates")
OUT = os.path.join(REPO, "tests", "data", "fixtures", "templates_real.json")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "Hi! What's 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And  3 + 3 ?\nThanks"}]
SYSTEM = [{"role": "system", "content": "You are terse."}] + CHAT
THOUGHT = [{"role": "user", "content": "Think: 5*5?"},
           {"role": "assistant", "content": "<think>\n5 times 5\n</think>\n\n25"},
           {"role": "user", "content": "And 6*6?"}]
TOOL_LOOP = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "{\"temp\": 17}"}]
CASES = {
    "Qwen-Qwen3-0.6B.jinja": [(CHAT, {}), (SYSTEM, {}), (CHAT, {"enable_thinking": False}),
                              (THOUGHT, {}), (THOUGHT, {"enable_thinking": False}), (TOOL_LOOP, {"tools": TOOLS}),
                              (CHAT, {"add_generation_prompt": False})],
    "google-gemma-2-2b-it.jinja": [(CHAT, {}), (CHAT, {"add_generation_prompt": False})],
    "microsoft-Phi-3.5-mini-instruct.jinja": [(CHAT, {}), (SYSTEM, {})],
}


def main():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(REPO, "tests", "data", "models", "stories260K"))
    doc = {}
    for name, cases in CASES.items():
        template = open(os.path.join(TEMPLATES, name), encoding="utf-8").read()
        rows = []
        for messages, kwargs in cases:
            kw = dict(kwargs)
            gen = kw.pop("add_generation_prompt", True)
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=gen, **kw)
            rows.append({"messages": messages, "add_generation_prompt": gen, "kwargs": kw, "text": text})
        doc[name] = rows
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {sum(map(len, doc.values()))} renderings to {OUT}")


if __name__ == "__main__":
    main()
