"""`bench replicas`: its pure parts (workload, affinity, /metrics parsing, tables, router
command lines, port picks), the tap and the stream client against a local stand-in, and
slow runs end to end with two simulated replicas: without a router, and behind vllm-router
``kv_aware`` fed by the replicas' KV events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

import pytest

from async_engine.bench.load import Slo, summarize
from async_engine.bench.replicas import client
from async_engine.bench.replicas.affinity import group_affinity, placements_from_counts
from async_engine.bench.replicas.cancel import CancelProbe
from async_engine.bench.replicas.client import (
    GROUP_HEADER,
    SESSION_HEADER,
    Sample,
    run_load,
    sse_events,
)
from async_engine.bench.replicas.processes import PICK_RANGE, free_port, replica_options
from async_engine.bench.replicas.report import (
    PhaseResult,
    cancel_table,
    format_table,
    latency_table,
    placement_table,
    router_kv_table,
)
from async_engine.bench.replicas.routers import (
    SESSION_TTL_S,
    RouterInput,
    VllmRouter,
    make_router,
)
from async_engine.bench.replicas.scrape import (
    ReplicaCounters,
    delta,
    parse_kv_lookups,
    parse_metrics,
)
from async_engine.bench.replicas.tap import Tap
from async_engine.bench.replicas.workload import (
    Prompt,
    Workload,
    build_prompts,
    burst_repeats,
    max_cached_tokens,
)

METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",model_name="default"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="default"} 3.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="default"} 1200.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="default"} 1184.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="default"} 512.0
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="default"} 2.0
vllm:request_success_total{finished_reason="length",model_name="default"} 5.0
vllm:request_success_total{finished_reason="abort",model_name="default"} 1.0
"""


def test_groups_share_their_prefix_and_nothing_else():
    w = Workload(groups=3, per_group=4, prefix_tokens=40, suffix_tokens=5, seed=7)
    prompts = build_prompts(w)
    assert len(prompts) == 12 and all(len(p.tokens) == 45 for p in prompts)
    prefixes = {p.group: p.tokens[:40] for p in prompts}
    assert all(p.tokens[:40] == prefixes[p.group] for p in prompts)
    assert len({tuple(v) for v in prefixes.values()}) == 3
    assert len({tuple(p.tokens) for p in prompts}) == 12
    assert [p.group for p in prompts] != sorted(p.group for p in prompts)  # shuffled
    assert build_prompts(w) == prompts
    assert build_prompts(w, salt=1)[0].tokens[:40] not in prefixes.values()


def test_the_most_cacheable_is_whole_prefix_blocks_after_each_groups_first():
    w = Workload(groups=3, per_group=4, prefix_tokens=40, suffix_tokens=5)
    assert max_cached_tokens(w, 16) == 3 * 3 * 32
    with pytest.raises(ValueError, match="groups"):
        Workload(groups=0)


def test_the_opening_burst_counts_repeated_groups_unless_streams_are_ramped():
    w = Workload(groups=2, per_group=4, concurrency=5)
    prompts = [Prompt(g, 0, [1]) for g in (0, 1, 0, 0, 1, 1, 0)]
    assert burst_repeats(prompts, w) == 3  # of the first five, 0 and 1 start groups
    assert burst_repeats(prompts, Workload(concurrency=2)) == 0
    assert burst_repeats(prompts, Workload(concurrency=5, ramp_ms=10)) == 0
    with pytest.raises(ValueError, match="ramp_ms"):
        Workload(ramp_ms=-1)


def test_affinity_is_the_majority_replicas_share_per_group():
    placements = [(0, 1)] * 4 + [(1, 0), (1, 1), (1, 0), (1, 1)]
    a = group_affinity(placements)
    assert (a.mean, a.worst, a.groups) == (0.75, 0.5, 2)
    assert group_affinity([]).groups == 0
    tallies = [Counter({"g0": 2, "g1": 1, "cancel": 3}), Counter({"g1": 3})]
    assert sorted(placements_from_counts(tallies)) == [(0, 0), (0, 0), (1, 0)] + [(1, 1)] * 3


def test_metrics_parse_into_counters_and_difference():
    after = parse_metrics(METRICS)
    assert after == ReplicaCounters(8.0, 1.0, 1200.0, 1184.0, 512.0, 3.0, 16)
    change = delta(ReplicaCounters(requests=2.0, prefix_hits=12.0, running=9.0), after)
    assert (change.requests, change.prefix_hits, change.running) == (6.0, 500.0, 3.0)
    assert change.block_size == 16


ROUTER_METRICS = """\
# TYPE vllm_router_kv_placement_lookups_total counter
vllm_router_kv_placement_lookups_total{result="hit"} 48
vllm_router_kv_placement_lookups_total{result="miss"} 16
vllm_router_kv_placement_lookups_total{result="missing_tokens"} 2
# TYPE vllm_router_kv_routing_inputs_total counter
vllm_router_kv_routing_inputs_total{transport="http",result="token_ids"} 128
"""


def test_router_kv_lookups_parse_by_result():
    assert parse_kv_lookups(ROUTER_METRICS) == {"hit": 48.0, "miss": 16.0, "missing_tokens": 2.0}
    assert parse_kv_lookups(METRICS) == {}


def _phase(name: str, **extra) -> PhaseResult:
    from async_engine.bench.load import RequestRecord

    rec = RequestRecord(sent=0.0, first_token=0.01, end=0.1, chunk_times=[0.01, 0.02], tokens=2)
    return PhaseResult(name, summarize([rec], 1.0, Slo()), 1.0, 100, 64, 32, **extra)


def test_tables_show_every_phase_and_dashes_for_what_was_not_seen():
    table = format_table(["a", "long header"], [["x", "1"], ["yyyy", "22"]])
    assert table.splitlines() == ["a     long header", "x     1", "yyyy  22"]
    seen = _phase("router", requests_per_replica=[3.0, 1.0], tapped_per_replica=[3, 1])
    seen.cached_metrics, seen.affinity = 48.0, group_affinity([(0, 0), (0, 0), (0, 1)])
    text = placement_table([seen, _phase("ray serve default")])
    router_row, ray_row = text.splitlines()[1:3]
    assert "3/1" in router_row and "0.67" in router_row and "75%" in router_row
    assert ray_row.split()[3:] == ["-"] * 6 + ["50%"]
    assert "TTFT p95" in latency_table([seen]) and "10.0" in latency_table([seen])
    seen.router_kv, seen.burst_repeats = {"hit": 5.0, "miss": 2.0, "odd": 1.0}, 2
    kv_rows = router_kv_table([seen, _phase("direct")]).splitlines()
    assert kv_rows[1].split() == ["router", "8", "5", "2", "0", "1", "2"]
    assert kv_rows[2].startswith("hit:")  # phases with no router have no row
    probes = [CancelProbe(0.001, 0.02, "abort counter"), CancelProbe(None, None, "none")]
    row = cancel_table({"direct": probes}).splitlines()[1]
    assert row.split() == ["direct", "2", "1.0", "1.0", "20.0", "20.0", "abort", "counter,none"]


def test_vllm_router_command_lines_parse_with_its_own_parser():
    launch = pytest.importorskip("vllm_router.launch_router")
    given = RouterInput(
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        ["tcp://127.0.0.1:5", "tcp://127.0.0.1:6"],
        16,
        "default",
    )
    plain = launch.parse_router_args(VllmRouter("power_of_two").command(given, 9, 10)[1:])
    assert plain.policy == "power_of_two" and plain.worker_urls == given.worker_urls
    assert plain.port == 9 and plain.prometheus_port == 10
    assert plain.log_level == "warning"
    kv = launch.parse_router_args(VllmRouter("kv_aware", "debug").command(given, 9, 10)[1:])
    assert kv.log_level == "debug"
    assert kv.kv_event_source == [
        "http://127.0.0.1:1=tcp://127.0.0.1:5",
        "http://127.0.0.1:2=tcp://127.0.0.1:6",
    ]
    assert kv.kv_event_block_size == 16 and kv.kv_event_model == "default"
    with pytest.raises(ValueError, match="policy"):
        make_router("vllm-router", "prefix-affinity")
    with pytest.raises(ValueError, match="log-level"):
        make_router("vllm-router", "kv_aware", "verbose")
    assert make_router("none", "power_of_two") is None


def test_sessions_ask_kv_aware_for_session_affinity_and_no_other_policy():
    launch = pytest.importorskip("vllm_router.launch_router")
    given = RouterInput(["http://127.0.0.1:1"], ["tcp://127.0.0.1:5"], 16, "default")
    router = VllmRouter("kv_aware", sessions=True)
    kv = launch.parse_router_args(router.command(given, 9, 10)[1:])
    assert kv.kv_aware_session_affinity_ttl_secs == SESSION_TTL_S
    assert router.label == "vllm-router kv_aware + sessions"
    plain = launch.parse_router_args(VllmRouter("kv_aware").command(given, 9, 10)[1:])
    assert plain.kv_aware_session_affinity_ttl_secs is None
    other = VllmRouter("power_of_two", sessions=True)
    assert "--kv-aware-session-affinity-ttl-secs" not in other.command(given, 9, 10)
    assert other.label == "vllm-router power_of_two"


def test_each_replica_gets_its_own_kv_event_port_only_when_asked():
    args = Namespace(device="sim", seed=0, kv_events_endpoint="tcp://*:5557")
    options, port = replica_options(args, kv_events=False)
    assert port is None and "kv_events_endpoint" not in options
    options, port = replica_options(args, kv_events=True)
    assert options["kv_events_endpoint"] == f"tcp://*:{port}"
    assert replica_options(Namespace(device="sim"), kv_events=True)[1] is None


def test_ports_are_picked_below_the_ephemeral_range_and_free():
    # Below it, no bind(0) or outgoing connection can take a port before its owner binds it.
    ports = {free_port() for _ in range(20)}
    assert all(PICK_RANGE[0] <= p < PICK_RANGE[1] for p in ports) and len(ports) > 1


async def _stand_in(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Each POST gets one text event and the usage, or (max_tokens of 100 or more) text
    events until the caller leaves; the connection is kept unless the caller asks to close."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            endless = json.loads(await reader.readexactly(length))["max_tokens"] >= 100
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            events = [{"choices": [{"text": "a"}]}]
            while events:
                data = f"data: {json.dumps(events.pop())}\n\n".encode()
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                await asyncio.sleep(0.001)
                if endless:
                    events.append({"choices": [{"text": "a"}]})
            usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(usage), usage))
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            if b"connection: close" in head.lower():
                break
    writer.close()


async def test_the_tap_counts_groups_on_reused_connections_and_sees_drops():
    server = await asyncio.start_server(_stand_in, "127.0.0.1", 0)
    tap = Tap("127.0.0.1", server.sockets[0].getsockname()[1])
    await tap.start()
    try:
        body = {"max_tokens": 4}
        headers = {GROUP_HEADER: "g3", "x-request-id": "r1"}
        events = [e async for e in sse_events(tap.url, "/v1/completions", body, headers)]
        assert events[-1]["usage"]["completion_tokens"] == 2 and len(events) == 2
        # Two requests on one connection, as a router sends them.
        reader, writer = await asyncio.open_connection("127.0.0.1", tap.port)
        for group in ("g1", "g2"):
            data = b'{"max_tokens": 1}'
            head = f"POST / HTTP/1.1\r\n{GROUP_HEADER}: {group}\r\nContent-Length: {len(data)}"
            writer.write(head.encode() + b"\r\n\r\n" + data)
            while b"0\r\n\r\n" not in await reader.readuntil(b"0\r\n\r\n"):
                pass
        writer.close()
        stream = sse_events(tap.url, "/", {"max_tokens": 1000}, {"x-request-id": "gone"})
        await anext(stream)
        await stream.aclose()
        for _ in range(100):
            if "gone" in tap.dropped:
                break
            await asyncio.sleep(0.01)
        assert tap.groups == Counter({"g3": 1, "g1": 1, "g2": 1})
        assert "gone" in tap.dropped
    finally:
        await tap.stop()
        server.close()


async def test_ramped_streams_start_apart_and_send_every_prompt(monkeypatch):
    sent: list[tuple[float, int]] = []

    async def slow_send(url, model, prompt, max_tokens, request_id, session) -> Sample:
        sent.append((time.perf_counter(), prompt.index))
        await asyncio.sleep(0.1)  # longer than the ramp: each stream's first send shows
        return Sample(prompt.group, 0)

    monkeypatch.setattr(client, "send", slow_send)
    w = Workload(groups=2, per_group=3, concurrency=3, ramp_ms=40)
    start = time.perf_counter()
    samples, _ = await run_load(["http://x"], "m", build_prompts(w), w, "ramp")
    assert len(samples) == 6 and sorted(i for _, i in sent) == [0, 0, 1, 1, 2, 2]
    times = sorted(t - start for t, _ in sent)
    # Streams 1 and 2 start 40 and 80 ms in, or later (a busy machine only delays them);
    # unramped, all three would send at once.
    assert times[1] >= 0.039 and times[2] >= 0.079


async def test_a_session_workload_names_each_request_s_group_as_its_session():
    heads: list[bytes] = []

    async def recording(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head.lower())
        await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(recording, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        for sessions in (True, False):
            heads.clear()
            w = Workload(groups=2, per_group=2, concurrency=1, sessions=sessions)
            await run_load([url], "m", build_prompts(w), w, "s")
            named = sorted(
                line.split(b":")[1].strip().decode()
                for head in heads
                for line in head.split(b"\r\n")
                if line.startswith(SESSION_HEADER.encode())
            )
            assert len(heads) == 4
            assert named == (["g0", "g0", "g1", "g1"] if sessions else [])
    finally:
        server.close()


@pytest.mark.slow
def test_two_replicas_without_a_router_end_to_end(tmp_path):
    out = tmp_path / "replicas.json"
    argv = ["bench", "replicas", "--router", "none", "--replicas", "2", "--groups", "2"]
    argv += ["--requests-per-group", "3", "--prefix-tokens", "64", "--suffix-tokens", "8"]
    argv += ["--output-tokens", "8", "--concurrency", "2", "--cancel-probes", "2"]
    cmd = [sys.executable, "-m", "async_engine.cli.main", *argv, "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "1 replica direct" in run.stdout and "2 direct, round robin" in run.stdout
    result = json.loads(out.read_text())
    one, both = result["phases"]
    for phase in (one, both):
        assert phase["summary"]["errors"] == 0 and phase["summary"]["completed"] == 6
        assert sum(phase["tapped_per_replica"]) == 6
        assert sum(phase["requests_per_replica"]) == 6  # each replica's own /metrics
    assert one["tapped_per_replica"] == [6, 0] and one["affinity"]["mean"] == 1.0
    assert both["tapped_per_replica"] == [3, 3]
    assert one["cached_metrics"] > 0 and one["cached_usage"] > 0
    probes = result["cancel"]["1 replica direct"]
    assert all(p["released_s"] is not None and p["dropped_s"] is not None for p in probes)


def _vllm_router_installed() -> bool:
    beside = Path(sys.executable).with_name("vllm-router")
    return beside.exists() or shutil.which("vllm-router") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _vllm_router_installed(), reason="vllm-router is not installed")
def test_vllm_router_kv_aware_follows_the_replicas_kv_events(tmp_path):
    """One stream, so every request after its group's first arrives once the first's blocks
    were announced: kv_aware must find each of those in the events and keep every group on
    one replica. (Streams sent together are the opening burst no event can precede.)"""
    out = tmp_path / "replicas.json"
    argv = ["bench", "replicas", "--router", "vllm-router", "--policy", "kv_aware"]
    argv += ["--groups", "2", "--requests-per-group", "3", "--prefix-tokens", "64"]
    argv += ["--suffix-tokens", "8", "--output-tokens", "4", "--concurrency", "1"]
    argv += ["--cancel-probes", "0"]
    cmd = [sys.executable, "-m", "async_engine.cli.main", *argv, "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    routed = json.loads(out.read_text())["phases"][0]
    assert routed["name"] == "vllm-router kv_aware" and routed["summary"]["errors"] == 0
    # Each group's first is a miss; its two followers hit the events of the first.
    assert routed["router_kv"] == {"hit": 4.0, "miss": 2.0}
    assert routed["affinity"]["mean"] == 1.0
    assert routed["cached_metrics"] == routed["max_cached"]
