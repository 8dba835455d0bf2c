"""LoRA adapters over the server (corelm serve --lora NAME=PATH): a request's model selects the adapter, /v1/models
lists each adapter with its parent model, the base model's name gets the base model."""
import pytest

from corelm import SamplingParams
from test_lora import STORIES, random_adapter, write_peft


def test_the_model_name_selects_the_adapter(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import corelm
    from corelm.entrypoints.cli.flags import lora_modules
    from test_server import running_server
    path = write_peft(tmp_path / "one", random_adapter(8, 1), 8, 16)
    loras = lora_modules([f"tuned={path}:0.5"])
    assert (loras[0].lora_name, loras[0].lora_path, loras[0].scale) == ("tuned", path, 0.5)

    def load():
        return corelm.LLM(STORIES, dtype="fp32", threads=1, max_seq_len=256, speculative_model=None,
                          lora_modules=loras)
    ref = load()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want_base = ref.generate("Once upon a time", greedy)[0].outputs[0].text
    want_lora = ref.generate("Once upon a time", greedy, lora_request=loras[0])[0].outputs[0].text
    assert want_base != want_lora
    with running_server(load) as s:
        assert s.state.wait_ready(30)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
        cards = {m.id: m for m in client.models.list().data}
        assert cards["tuned"].parent == s.state.config.model_name and cards["tuned"].root == path
        for model, want in (("tuned", want_lora), (s.state.config.model_name, want_base)):
            r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == want and r.model == model
