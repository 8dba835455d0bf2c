"""tools/fuzz/fuzz.py in CI: every target (GGUF, HF folder, corelm folder, chat template) runs for a bounded,
seeded time and must show no crash, no hang and no exception other than ModelLoadError (templates:
ChatTemplateError). Longer runs: python tools/fuzz/fuzz.py --target gguf --seconds 600 --seed 1."""
import os

import pytest

from conftest import tool_module

fuzz = tool_module("fuzz")

SECONDS = float(os.environ.get("CORELM_FUZZ_SECONDS", "25"))


@pytest.mark.parametrize("target", fuzz.TARGETS)
def test_fuzz_target_finds_nothing(target, tmp_path):
    r = fuzz.fuzz(target, SECONDS, seed=1, timeout=10.0, failures_dir=str(tmp_path / "failures"), verbose=False)
    assert not r["seed_problems"], r["seed_problems"]
    assert r["counts"]["ok"] > 0 and r["counts"]["refused"] > 0, r
    assert r["inputs"] >= 200, r        # a run that got nowhere tests nothing
    assert not r["failures"], "\n\n".join(f"{f['status']}: {f['error']}\n{f.get('where', '')}\n(saved: {f['input']})"
                                          for f in r["failures"][:5])


def test_the_harness_counts_crashes_hangs_and_foreign_exceptions(tmp_path):
    w = fuzz.Worker("selftest", timeout=3.0)
    try:
        w.start()
        outcomes = []
        for what in ("ok", "refused", "foreign", "crash", "ok", "hang", "ok"):
            p = tmp_path / what
            p.write_bytes(what.encode())
            outcomes.append(w.run(str(p))["status"])
    finally:
        w.stop()
    assert outcomes == ["ok", "refused", "foreign", "crash", "ok", "hang", "ok"]


def test_mutations_are_seeded():
    seeds = fuzz.load_seeds("gguf")
    runs = []
    for _ in range(2):
        rng = fuzz.random.Random("gguf:5")
        runs.append([fuzz.mutate("gguf", seeds[0][1], rng, [s for _, s in seeds]) for _ in range(50)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 40
