"""Tenant fairness through the server: a trickle is not stuck behind another tenant's burst."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from server_helpers import start_server

from async_engine.client import AsyncClient, Chunk
from async_engine.server.app import ServerOptions
from async_engine.v1 import generation_pb2 as pb
from async_engine.v1 import generation_pb2_grpc as pb_grpc

SIM = {
    "device": "sim",
    "dtype": "bfloat16",
    "sim_step_ms": 2,
    "sim_token_us": 0,
    "sim_seq_us": 0,
    "sim_ctx_ns": 0,
    "max_num_seqs": 4,
}


async def first_token_time(client: AsyncClient, tenant: str, max_tokens: int) -> float:
    """When the request's first token arrived (it is read to its end)."""
    first = None
    async for event in client.generate(
        [5, 6, 7], max_tokens=max_tokens, ignore_eos=True, tenant=tenant
    ):
        if isinstance(event, Chunk) and first is None:
            first = time.monotonic()
    assert first is not None
    return first


async def trickle_by_metadata(address: str) -> float:
    """A request whose tenant comes in the x-tenant metadata entry, not the field."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 6, 7]), stop=pb.StopParams(max_tokens=4, ignore_eos=True)
        )
        first = None
        async for reply in stub.Generate(request, metadata=(("x-tenant", "trickle"),)):
            if reply.WhichOneof("kind") == "chunk" and first is None:
                first = time.monotonic()
    assert first is not None
    return first


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
async def test_a_trickles_first_tokens_come_before_the_bursts_queue_drains(
    default_model: Path, policy: str
):
    server = start_server(
        default_model, ServerOptions(port=0, metrics_port=None), scheduling_policy=policy, **SIM
    )
    try:
        async with AsyncClient(server.address) as client:
            burst = [asyncio.create_task(first_token_time(client, "burst", 64)) for _ in range(40)]
            await asyncio.sleep(0.2)
            load = await client.load()
            assert load.tenants["burst"][0] > 20  # most of the burst waits
            trickle = [await first_token_time(client, "trickle", 4) for _ in range(2)]
            trickle.append(await trickle_by_metadata(server.address))
            burst_firsts = sorted(await asyncio.gather(*burst))
        before_drain = [t < burst_firsts[-1] for t in trickle]
        if policy == "fair":
            assert all(before_drain)
        else:  # the control: first come, first served puts the trickle behind the burst
            assert not any(before_drain)
    finally:
        server.close()


async def test_the_x_tenant_metadata_names_the_tenant_of_a_request_without_one(
    default_model: Path,
):
    server = start_server(default_model, ServerOptions(port=0, metrics_port=None), **SIM)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                stop=pb.StopParams(max_tokens=2000, ignore_eos=True),
            )
            call = stub.Generate(request, metadata=(("x-tenant", "from-metadata"),))
            async for reply in call:
                if reply.WhichOneof("kind") == "chunk":
                    break
            tenants = {r.tenant for r in list(server.engine.scheduler.requests.values())}
            call.cancel()
        assert tenants == {"from-metadata"}
    finally:
        server.close()
