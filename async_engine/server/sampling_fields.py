"""Where a client sets each SamplingParams field in a GenerateRequest.

``sampler.params.FIELDS`` laid onto the proto descriptor by name (``async_engine.v1.fields``):
the codec decodes the settings from this table and the error table names their paths from
it, so that neither lists the fields again.
"""

from __future__ import annotations

from async_engine.v1.fields import Place, place
from sampler.params import FIELDS


def _placed(name: str) -> Place:
    found = place(name)
    if found is None:
        # At import, so that a setting added to SamplingParams alone fails every test at once.
        raise ValueError(
            f"SamplingParams.{name} has no field in GenerateRequest: add one to "
            "proto/async_engine/v1/generation.proto, or declare it with grpc=False"
        )
    return found


PLACES: dict[str, Place] = {spec.name: _placed(spec.name) for spec in FIELDS if spec.grpc}
