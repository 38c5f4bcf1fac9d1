import numpy as np
import pytest

from freetoken.engine.decoding.sampling import Sampler, SamplingParams


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


def test_seed_reproduces():
    logits = np.random.default_rng(0).standard_normal(50)
    a = [Sampler(SamplingParams(temperature=1.0, seed=5))(logits) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=5)), Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [s1(logits) for _ in range(20)] == [s2(logits) for _ in range(20)]
    assert len(set(a)) == 1


def test_top_k_restricts_support():
    logits = np.arange(10, dtype=np.float64)
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    assert {s(logits) for _ in range(300)} == {7, 8, 9}


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert {s(np.log(probs)) for _ in range(300)} == {0, 1}


def test_distribution_matches_softmax():
    logits = np.array([1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts = np.bincount([s(logits) for _ in range(6000)], minlength=3) / 6000
    want = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(counts, want, atol=0.03)


def test_repetition_penalty_lowers_seen_tokens():
    logits = np.array([2.0, 1.9, -1.0])
    greedy = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert greedy(logits, previous=[0]) == 1


def test_logit_bias_bans_and_favours_tokens():
    logits = np.array([2.0, 1.9, -1.0, 0.0])
    assert Sampler(SamplingParams(temperature=0, logit_bias=((0, -100.0),)))(logits) == 1
    assert Sampler(SamplingParams(temperature=0, logit_bias=((2, 3.5),)))(logits) == 2
    s = Sampler(SamplingParams(temperature=1.0, seed=3, logit_bias=((0, -100.0), (1, -100.0))))
    assert {s(logits) for _ in range(200)} == {2, 3}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(repetition_penalty=0),
                                 dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((3, 101.0),))])
def test_bad_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
