"""The n > 1 fan-out rule, in its one place (async_engine.core.fanout)."""

from __future__ import annotations

from async_engine.core.fanout import child_ids, child_params, parent_id
from async_engine.server.codec import Limits, decode_request
from async_engine.v1 import generation_pb2 as pb
from sampler.params import SamplingParams


def test_one_sample_runs_as_the_request_itself():
    params = SamplingParams(seed=7)
    assert child_ids("req#1", 1) == ["req#1"]  # a "#" in a caller's id is left alone
    assert child_params(params, 1, 0) is params


def test_n_samples_become_children_with_distinct_seeds():
    params = SamplingParams(n=3, seed=7, temperature=0.5)
    ids = child_ids("req#x", 3)
    assert ids == ["req#x#0", "req#x#1", "req#x#2"]
    assert all(parent_id(c) == "req#x" for c in ids)
    children = [child_params(params, 3, i) for i in range(3)]
    assert [p.seed for p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.5 for p in children)
    assert child_params(SamplingParams(n=2), 2, 1).seed is None


def test_the_server_codec_follows_the_rule():
    msg = pb.GenerateRequest(request_id="r", text="hi")
    msg.sampling.n = 2
    msg.sampling.seed = 40
    sub = decode_request(msg, Limits())
    assert sub.params.n == 2  # core.group fans it out
    assert [child_params(sub.params, sub.params.n, i).seed for i in range(2)] == [40, 41]
