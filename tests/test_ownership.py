"""Ownership with a token file: each token is a principal with its tenants and priority
floor; request ids are scoped to their principal (another's ids are simply unknown)."""

from __future__ import annotations

import asyncio
import http.client
import json
from pathlib import Path

import pytest
from server_helpers import start_server

from async_engine.client import AlreadyExists, AsyncClient, Chunk, PermissionDenied
from async_engine.server.app import BackgroundServer, ServerOptions
from async_engine.server.auth import Principal, Principals

GREEDY = {"temperature": 0.0, "ignore_eos": True}
TOKENS = {
    "tokens": [
        {
            "token": "token-search",
            "principal": "search",
            "tenants": ["search", "search-batch"],
            "min_priority": 0,
        },
        {"token": "token-ops", "principal": "ops"},
        {"token": "token-batch", "principal": "batch", "min_priority": 10},
    ]
}


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("auth") / "tokens.json"
    path.write_text(json.dumps(TOKENS))
    options = ServerOptions(port=0, metrics_port=None, http_port=0, auth_token_file=str(path))
    srv = start_server(tiny_model, options)
    yield srv
    srv.close()


async def running(client: AsyncClient, request_id: str, **options) -> asyncio.Task:
    started = asyncio.Event()

    async def run() -> None:
        async for event in client.generate(
            [5] * 4, request_id=request_id, max_tokens=1000, **GREEDY, **options
        ):
            if isinstance(event, Chunk):
                started.set()

    task = asyncio.create_task(run())
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait((task, waiter), timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # it failed before its first token: say why
    return task


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_another_principals_request_id_is_unknown_to_abort(server: BackgroundServer):
    async with (
        AsyncClient(server.address, token="token-search") as search,
        AsyncClient(server.address, token="token-ops") as ops,
    ):
        task = await running(search, "job-1")
        try:
            assert await ops.abort(["job-1"]) == ([], ["job-1"])
            assert not task.done()
            assert await search.abort(["job-1"]) == (["job-1"], [])
        finally:
            await stop(task)


async def test_the_same_request_id_is_free_in_another_scope_and_taken_in_its_own(
    server: BackgroundServer,
):
    async with (
        AsyncClient(server.address, token="token-search") as search,
        AsyncClient(server.address, token="token-ops") as ops,
    ):
        task = await running(search, "job-2")
        try:
            other = [e async for e in ops.generate([7] * 4, request_id="job-2", max_tokens=4)]
            assert sum(len(e.token_ids) for e in other if isinstance(e, Chunk)) == 4
            with pytest.raises(AlreadyExists):
                async for _ in search.generate([7] * 4, request_id="job-2", max_tokens=4):
                    pass
        finally:
            await stop(task)


async def test_a_tenant_outside_the_tokens_list_is_denied_naming_the_field(
    server: BackgroundServer,
):
    async with AsyncClient(server.address, token="token-search") as search:
        with pytest.raises(PermissionDenied) as info:
            async for _ in search.generate([7] * 4, tenant="ops", max_tokens=4):
                pass
        assert "tenant" in info.value.field_violations


async def test_a_request_without_tenant_runs_as_the_tokens_first_tenant(server: BackgroundServer):
    async with AsyncClient(server.address, token="token-search") as search:
        task = await running(search, "job-3")
        try:
            req = server.engine.scheduler.requests["search/job-3"]
            assert req.tenant == "search"
        finally:
            await stop(task)


async def test_a_priority_more_urgent_than_the_floor_is_denied(server: BackgroundServer):
    async with (
        AsyncClient(server.address, token="token-search") as search,
        AsyncClient(server.address, token="token-ops") as ops,
    ):
        with pytest.raises(PermissionDenied) as info:
            async for _ in search.generate([7] * 4, priority=-(2**31), max_tokens=4):
                pass
        assert "priority" in info.value.field_violations
        done = [e async for e in ops.generate([7] * 4, priority=-(2**31), max_tokens=4)]
        assert done  # a principal without a floor may ask for any priority


def post(server: BackgroundServer, body: dict, token: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    try:
        headers = {"content-type": "application/json", "authorization": f"Bearer {token}"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_http_maps_the_bearer_token_to_its_principal(server: BackgroundServer):
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 2}
    assert post(server, body, "nope")[0] == 401
    status, denied = post(server, {**body, "user": "ops"}, "token-search")
    assert (status, denied["error"]["param"]) == (403, "user")
    assert post(server, {**body, "user": "search-batch"}, "token-search")[0] == 200


def test_an_http_request_runs_at_its_principals_priority_floor(server: BackgroundServer):
    body = {
        "model": "default",
        "prompt": [5, 6, 7],
        "max_tokens": 1000,
        "stream": True,
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=30)
    try:
        headers = {"content-type": "application/json", "authorization": "Bearer token-batch"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()  # its first event: the request is in the engine
        running = [
            r for rid, r in server.engine.scheduler.requests.items() if rid.startswith("batch/")
        ]
        assert [r.priority for r in running] == [10]  # not 0, which would overtake others
    finally:
        conn.close()


def test_http_refuses_a_priority_more_urgent_than_the_floor_naming_it(server: BackgroundServer):
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 2}
    status, denied = post(server, {**body, "priority": 3}, "token-batch")
    assert (status, denied["error"]["param"]) == (403, "priority")
    assert post(server, {**body, "priority": 12}, "token-batch")[0] == 200
    assert post(server, {**body, "priority": -5}, "token-ops")[0] == 200  # no floor


def test_the_floor_is_one_rule_for_both_front_ends():
    floor = Principal("batch", min_priority=10)
    assert floor.admit("", None) == ("", 10)  # unnamed: the floor
    assert floor.admit("t", 15) == ("t", 15)
    with pytest.raises(ValueError, match="more urgent"):
        floor.admit("t", 9)
    assert Principal("any").admit("t", None) == ("t", 0)
    assert Principal("urgent", min_priority=-3).admit("t", None) == ("t", 0)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("{not json", "auth token file"),
        ('{"tokens": {}}', 'expected {"tokens": [...]}'),
        ('{"tokens": [{"token": "a"}]}', "principal must be"),
        (
            '{"tokens": [{"token": "a", "principal": "x"}, {"token": "a", "principal": "y"}]}',
            "the same token is listed twice",
        ),
        ('{"tokens": [{"token": "a", "principal": "x", "tenants": []}]}', "tenants must be"),
        (
            '{"tokens": [{"token": "a", "principal": "x", "min_priority": "high"}]}',
            "min_priority must be an integer",
        ),
        ('{"tokens": [{"token": "a", "principal": "x", "role": "admin"}]}', "unknown keys"),
    ],
)
def test_a_bad_token_file_is_refused_naming_the_problem(tmp_path: Path, text: str, complaint: str):
    path = tmp_path / "tokens.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="tokens.json") as info:
        Principals.load(path)
    assert complaint in str(info.value)


def test_lookup_finds_only_exact_bearer_tokens():
    principals = Principals({"abc": Principal("a"), "abd": Principal("b")})
    assert principals.lookup("Bearer abd") == Principal("b")
    assert principals.lookup("Bearer ab") is None
    assert principals.lookup("abc") is None
    assert principals.lookup(None) is None
