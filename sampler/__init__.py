"""Sampling settings and the batched sampler; depends only on torch and the stdlib."""

from sampler.params import MAX_LOGPROBS, SamplingParams
from sampler.sampler import Sampler, SampleResult, SlotState

__all__ = ["MAX_LOGPROBS", "SampleResult", "Sampler", "SamplingParams", "SlotState"]
