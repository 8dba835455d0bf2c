"""SamplingParams validation and the Sampler's arithmetic and statistics."""
import math

import numpy as np
import pytest

from corelm.engine.sampling import (Sampler, SamplingParams, apply_penalties, compute_logprobs)

# --------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(temperature=-1.0), "temperature must be non-negative, got -1.0."),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5."),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (dict(top_k=-2), "top_k must be 0 or -1 (disable), or at least 1, got -2."),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3.0."),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(logprobs=-1), "logprobs must be non-negative, got -1."),
    (dict(stop=["a", ""]), "stop cannot contain an empty string."),
    (dict(stop=""), "stop cannot contain an empty string."),
    (dict(stop=[1]), "stop must be a string or a list of strings"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must contain non-negative token ids, got -1."),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of integers"),
    (dict(temperature=0, n=2), "n must be 1 when using greedy sampling, got 2."),
])
def test_out_of_range_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_floats_are_rejected(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens="5"), "max_tokens must be an integer, got '5' (str)."),
    (dict(max_tokens=5.0), "max_tokens must be an integer, got 5.0 (float)."),
    (dict(top_k=True), "top_k must be an integer, got True (bool)."),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5' (str)."),
    (dict(temperature=False), "temperature must be a number, got False (bool)."),
    (dict(seed=1.5), "seed must be an integer, got 1.5 (float)."),
    (dict(logprobs=True), "logprobs must be an integer, got True (bool)."),
    (dict(ignore_eos=1), "ignore_eos must be True or False, got 1 (int)."),
    (dict(stop_token_ids=[1, True]), "stop_token_ids[1] must be an integer, got True (bool)."),
])
def test_wrong_types_are_rejected(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None
    q = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=(1, np.int32(2)))
    assert type(q.temperature) is float and type(q.top_k) is int and q.stop_token_ids == [1, 2]


def test_greedy_resets_truncation_like_vllm():
    p = SamplingParams.greedy(top_p=0.5, top_k=3, min_p=0.2, max_tokens=8)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 0, 0.0, 8)


def test_validate_against_vocab():
    SamplingParams(stop_token_ids=[9]).validate_against_vocab(10)
    with pytest.raises(ValueError, match=r"stop_token_ids contains 10, outside the vocabulary \[0, 10\)"):
        SamplingParams(stop_token_ids=[10]).validate_against_vocab(10)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SamplingParams(stop_token_ids=[10]), vocab_size=10)
    with pytest.raises(ValueError, match="logprobs must be at most"):
        SamplingParams(logprobs=11).validate_against_vocab(10)


# --------------------------------------------------------------------------------------------------
# Deterministic behaviour

def _logits(v=1000, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(v) * scale).astype(np.float32)


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    x = _logits()
    s = Sampler(SamplingParams(temperature=0), vocab_size=len(x))
    assert s.sample(x) == int(np.argmax(x))
    tie = np.zeros(8, np.float32)
    tie[[5, 3, 6]] = 2.0
    assert Sampler(SamplingParams(temperature=0), 8).sample(tie) == 3


def test_sample_does_not_modify_the_callers_logits():
    x = _logits()
    before = x.copy()
    s = Sampler(SamplingParams(temperature=0.7, repetition_penalty=1.3, min_tokens=3, top_p=0.9),
                vocab_size=len(x), eos_token_ids=[1])
    s.start([1, 2, 3])
    for _ in range(5):
        s.sample(x)
    np.testing.assert_array_equal(x, before)


def _run(params, steps=30, v=1000):
    s = Sampler(params, vocab_size=v)
    s.start([1, 2, 3])
    return [s.sample(_logits(v, seed=i)) for i in range(steps)]


def test_same_seed_same_output_and_different_seed_differs():
    a = _run(SamplingParams(temperature=1.0, seed=1234))
    assert a == _run(SamplingParams(temperature=1.0, seed=1234))
    assert a != _run(SamplingParams(temperature=1.0, seed=4321))
    # start() reseeds, so a reused Sampler repeats itself too
    s = Sampler(SamplingParams(temperature=1.0, seed=7, top_p=0.9), vocab_size=1000)
    runs = []
    for _ in range(2):
        s.start([1])
        runs.append([s.sample(_logits(seed=i)) for i in range(20)])
    assert runs[0] == runs[1]


def test_negative_seed_is_reproducible():
    assert _run(SamplingParams(seed=-5)) == _run(SamplingParams(seed=-5))


def test_top_k_1_and_tiny_top_p_equal_greedy():
    greedy = _run(SamplingParams(temperature=0))
    assert _run(SamplingParams(temperature=1.5, top_k=1, seed=3)) == greedy
    assert _run(SamplingParams(temperature=1.5, top_p=1e-6, seed=3)) == greedy
    assert _run(SamplingParams(temperature=1.5, min_p=1.0, seed=3)) == greedy


def test_top_k_only_draws_from_the_k_best():
    x = _logits(2000, scale=1.0)
    best = set(np.argsort(-x)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, seed=0), 2000)
    drawn = {s.sample(x) for _ in range(2000)}
    assert drawn == best


def test_top_p_keeps_the_smallest_nucleus():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps exactly the first two (0.5 + 0.3 >= 0.8)
    x = np.log(np.array([0.15, 0.5, 0.05, 0.3], np.float32))
    s = Sampler(SamplingParams(top_p=0.8, seed=0), 4)
    counts = np.bincount([s.sample(x) for _ in range(5000)], minlength=4)
    assert counts[0] == counts[2] == 0
    assert abs(counts[1] / 5000 - 0.5 / 0.8) < 0.03


def test_min_p_excludes_low_probability_tokens():
    # p = [0.6, 0.25, 0.1, 0.05]; min_p=0.2 -> threshold 0.12 keeps ids 0 and 1 only
    p = np.array([0.6, 0.25, 0.1, 0.05])
    x = np.log(p).astype(np.float32)
    s = Sampler(SamplingParams(min_p=0.2, seed=11), 4)
    counts = np.bincount([s.sample(x) for _ in range(10000)], minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 10000 - 0.6 / 0.85) < 0.02
    # without min_p the same seed does draw them
    s = Sampler(SamplingParams(seed=11), 4)
    counts = np.bincount([s.sample(x) for _ in range(10000)], minlength=4)
    assert counts[2] > 0 and counts[3] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    x = np.array([1.0, 2.0, 0.5, -1.0, 1.5], np.float32)
    expected = np.exp(x / temperature) / np.exp(x / temperature).sum()
    s = Sampler(SamplingParams(temperature=temperature, seed=42), 5)
    draws = 20000
    freq = np.bincount([s.sample(x) for _ in range(draws)], minlength=5) / draws
    # 4.5 standard errors per token: a false alarm is ~1e-5 per token with a fixed seed anyway
    tol = 4.5 * np.sqrt(expected * (1 - expected) / draws)
    assert np.all(np.abs(freq - expected) < tol), (freq, expected)


def test_large_vocabulary_draw_matches_probabilities():
    # spreads the mass over ids in different 1024-blocks to exercise the two-level draw
    v = 20000
    x = np.full(v, -30.0, np.float32)
    ids = np.array([3, 1500, 7000, 19999])
    x[ids] = np.log([0.1, 0.2, 0.3, 0.4])
    s = Sampler(SamplingParams(seed=5), v)
    draws = 10000
    got = np.array([s.sample(x) for _ in range(draws)])
    assert set(np.unique(got).tolist()) <= set(ids.tolist())
    freq = np.array([(got == i).mean() for i in ids])
    assert np.all(np.abs(freq - [0.1, 0.2, 0.3, 0.4]) < 0.02), freq


def test_masked_tokens_are_never_drawn():
    x = np.zeros(10, np.float32)
    x[4] = -np.inf
    s = Sampler(SamplingParams(temperature=3.0, seed=0), 10)
    assert 4 not in {s.sample(x) for _ in range(2000)}


# --------------------------------------------------------------------------------------------------
# Penalties and min_tokens

def test_apply_penalties_matches_hand_computation():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], np.float32)
    prompt, output = [0, 1], [2, 2, 4, 1]
    rep, pres, freq = 2.0, 0.5, 0.25
    got = apply_penalties(logits, prompt, output, rep, pres, freq)
    expected = [
        2.0 / 2,                      # prompt only: repetition (positive -> divided)
        -1.0 * 2 - 0.25 * 1 - 0.5,    # prompt and output once: repetition (negative -> multiplied), then both
        0.5 / 2 - 0.25 * 2 - 0.5,     # output twice
        3.0,                          # never seen
        -2.0 * 2 - 0.25 * 1 - 0.5,    # output once
        1.0,                          # never seen
    ]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_array_equal(apply_penalties(logits, prompt, output), logits)   # neutral values


def test_sampler_penalties_are_incremental_and_match_helper():
    v = 50
    params = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    prompt = [1, 2, 3, 2]
    s = Sampler(params, v)
    s.start(prompt)
    out = []
    for step in range(15):
        x = _logits(v, seed=step)
        expected = int(np.argmax(apply_penalties(x, prompt, out, 1.3, 0.4, 0.2)))
        tok = s.sample(x)
        assert tok == expected
        out.append(tok)
        if step % 2:
            s.accept(tok)    # accepting the sampled token again must not count it twice


def test_stateless_call_form_matches_stateful():
    v, prompt = 100, [4, 5, 6]
    params = SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.5, frequency_penalty=1.0)
    a = Sampler(params, v)
    a.start(prompt)
    b = Sampler(params, v)
    out_a, out_b = [], []
    for step in range(20):
        x = _logits(v, seed=step)
        out_a.append(a.sample(x))
        out_b.append(b.sample(x, prompt, out_b))
    assert out_a == out_b


def test_accept_records_a_forced_token():
    v = 10
    s = Sampler(SamplingParams(temperature=0, presence_penalty=2.0), v)
    s.start([])
    x = np.zeros(v, np.float32)
    x[7] = 1.0
    assert s.sample(x) == 7
    s.accept(3)                 # the engine replaced 7 by 3: 3 is penalised, 7 is not
    assert s.num_output_tokens == 1
    y = np.zeros(v, np.float32)
    y[3], y[7] = 1.5, 1.0
    assert s.sample(y) == 7


def test_min_tokens_masks_eos_and_stop_ids():
    v = 6
    x = np.zeros(v, np.float32)
    x[5], x[4], x[1] = 3.0, 2.0, 1.0       # 5 = eos, 4 = stop id
    s = Sampler(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]), v, eos_token_ids=[5])
    s.start([0])
    assert [s.sample(x) for _ in range(3)] == [1, 1, 5]
    # ignore_eos: EOS is not a stop token, so min_tokens does not mask it
    s = Sampler(SamplingParams(temperature=0, min_tokens=2, ignore_eos=True), v, eos_token_ids=[5])
    assert s.sample(x) == 5


def test_out_of_vocabulary_ids_are_rejected():
    s = Sampler(SamplingParams(repetition_penalty=1.2), 10)
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        s.start([1, 10])
    with pytest.raises(ValueError, match="expected 10"):
        s.sample(np.zeros(11, np.float32))


# --------------------------------------------------------------------------------------------------
# Logprobs

def test_logprobs_are_of_the_raw_distribution():
    x = np.array([1.0, 3.0, 2.0, 0.0], np.float32)
    ref = x - math.log(np.exp(x.astype(np.float64)).sum())
    chosen, rank, top = compute_logprobs(x, 2, 2)
    assert chosen == pytest.approx(ref[2], abs=1e-6) and rank == 2
    assert compute_logprobs(x, 3)[1] == 4 and compute_logprobs(x, 1)[1] == 1
    assert [t for t, _ in top] == [1, 2]
    assert [lp for _, lp in top] == pytest.approx([ref[1], ref[2]], abs=1e-6)
    s = Sampler(SamplingParams(temperature=0, logprobs=1, repetition_penalty=2.0), 4)
    s.start([1])
    tok = s.sample(x)
    chosen, rank, top = s.logprobs(x, tok)
    assert chosen == pytest.approx(ref[tok], abs=1e-6) and top[0][0] == 1 and rank == 1 + int((x > x[tok]).sum())
    assert Sampler(SamplingParams(), 4).logprobs(x, 0) is None
