"""Where a sampling setting lives in a GenerateRequest, found on the descriptor by name.

Hand-written beside the generated stubs (``make proto`` leaves it alone) so that server and
client share one rule: a setting is the field of that name in ``sampling``, ``stop`` or
``output``, or one of the few that the proto spells otherwise. A field added to those
messages needs no list in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from async_engine.v1 import generation_pb2 as pb

# The GenerateRequest fields whose messages hold the settings, searched in this order.
SETTINGS = ("sampling", "stop", "output")
# Engine names (sampler.params.SamplingParams) that the proto spells otherwise.
RENAMES = {"include_stop_str_in_output": "stop.include_stop_str"}

_REQUEST = pb.GenerateRequest.DESCRIPTOR


@dataclass(frozen=True, slots=True)
class Place:
    path: str  # where a client sets it, as a BadRequest names it: "stop.include_stop_str"
    part: str  # the GenerateRequest field holding it; "" where it is one ("structured_output")
    field: FieldDescriptor  # in part's message, or in GenerateRequest where part is ""


def place(name: str) -> Place | None:
    """Where the setting ``name`` (engine or proto spelling) lives; None: nowhere."""
    renamed = RENAMES.get(name)
    candidates = [renamed.split(".")] if renamed else [[part, name] for part in SETTINGS]
    for part, proto_name in candidates:
        field = _REQUEST.fields_by_name[part].message_type.fields_by_name.get(proto_name)
        if field is not None:
            return Place(f"{part}.{proto_name}", part, field)
    # A setting that is a GenerateRequest field of its own (a oneof message): decoded by hand.
    field = _REQUEST.fields_by_name.get(name)
    return Place(name, "", field) if field is not None and field.message_type else None
