"""MORI's CPU data plane: one-sided READ/WRITE between two engines, descriptors, extent checks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from vllm_fix_testing import mori_dataplane as mori


@pytest.fixture(params=["one-sided", "socket"], autouse=True)
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both data paths: one-sided (process_vm_readv/writev) and the NIC threads' socket."""
    monkeypatch.setattr(mori.IOEngine, "one_sided", request.param == "one-sided")
    return str(request.param)


def _wait(status: mori.TransferStatus, timeout: float = 10.0) -> mori.TransferStatus:
    deadline = time.monotonic() + timeout
    while status.InProgress() and time.monotonic() < deadline:
        time.sleep(0.001)
    return status


def _pair() -> tuple[mori.IOEngine, mori.IOEngine]:
    a = mori.IOEngine("producer:a", mori.IOEngineConfig("127.0.0.1", 0))
    b = mori.IOEngine("consumer:b", mori.IOEngineConfig("127.0.0.1", 0))
    for engine in (a, b):
        engine.create_backend(mori.BackendType.RDMA, mori.RdmaBackendConfig(1, -1, 1))
    # Descriptors travel packed, as vLLM's handshake carries them.
    a.register_remote_engine(mori.EngineDesc.unpack(b.get_engine_desc().pack()))
    b.register_remote_engine(mori.EngineDesc.unpack(a.get_engine_desc().pack()))
    return a, b


def test_descriptor_reports_the_auto_bound_port() -> None:
    a, b = _pair()
    assert a.get_engine_desc().port == a.listener.getsockname()[1] != 0  # type: ignore[union-attr]
    a.close()
    b.close()


def test_read_and_write_move_bytes_between_registered_regions() -> None:
    a, b = _pair()
    src = torch.arange(1024, dtype=torch.float32)
    dst = torch.zeros(1024, dtype=torch.float32)
    src_desc = mori.MemoryDesc.unpack(a.register_torch_tensor(src).pack())
    dst_desc = b.register_torch_tensor(dst)
    # b READs [64, 128) floats of a's region into its own [0, 64).
    read = b.create_session(dst_desc, src_desc).batch_read([0], [64 * 4], [64 * 4], b.allocate_transfer_uid())
    assert _wait(read).Succeeded(), read
    assert torch.equal(dst[:64], src[64:128]) and not dst[64:].any()
    # a WRITEs two ranges into b's region.
    write = a.create_session(src_desc, mori.MemoryDesc.unpack(dst_desc.pack())).batch_write(
        [0, 512 * 4], [512 * 4, 1000 * 4], [16 * 4, 8 * 4], 7
    )
    assert _wait(write).Succeeded(), write
    assert torch.equal(dst[512:528], src[:16]) and torch.equal(dst[1000:1008], src[512:520])
    a.close()
    b.close()


def test_an_access_outside_the_memory_region_fails_the_status() -> None:
    a, b = _pair()
    src_desc = a.register_torch_tensor(torch.ones(256))
    dst = torch.zeros(256)
    status = b.create_session(b.register_torch_tensor(dst), src_desc).read(0, 200 * 4, 100 * 4, 1)
    assert _wait(status).Failed() and status.Code() == mori.ERR_RDMA_OP
    assert "outside memory region" in status.Message()
    assert not dst.any()  # nothing landed
    a.close()
    b.close()


def test_a_non_contiguous_tensor_is_refused() -> None:
    engine = mori.IOEngine("producer:c", mori.IOEngineConfig("127.0.0.1", 0))
    with pytest.raises(ValueError, match="contiguous"):
        engine.register_torch_tensor(torch.zeros(8, 8).t())


def test_the_written_package_is_what_vllm_imports(tmp_path: Path) -> None:
    import subprocess
    import sys

    mori.write_mori_package(tmp_path)
    code = (
        "import mori, torch; from mori.io import IOEngine, MemoryDesc, EngineDesc, BackendType, PollCqMode, "
        "RdmaBackendConfig, XgmiBackendConfig; e = torch.cuda.Event(); "
        "e.record(torch.cuda.current_stream()); "
        "e.synchronize(); print(mori.__version__, IOEngine.__module__)"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.1.0", "vllm_fix_testing.mori_dataplane"]


CHILD = """
import sys, torch
from vllm_fix_testing import mori_dataplane as mori
engine = mori.IOEngine("producer:child", mori.IOEngineConfig("127.0.0.1", 0))
engine.create_backend(mori.BackendType.RDMA, mori.RdmaBackendConfig(1, -1, 1))
region = torch.arange(256, dtype=torch.float32)
print(engine.get_engine_desc().pack().hex(), engine.register_torch_tensor(region).pack().hex(), flush=True)
sys.stdin.readline()  # the parent has written
print(region[:8].tolist(), flush=True)
"""


def test_transfers_reach_another_process_memory(data_path: str) -> None:
    """The peer is another process (as each engine's worker is): READ its region, WRITE into it."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        engine_hex, region_hex = child.stdout.readline().split()
        peer = mori.EngineDesc.unpack(bytes.fromhex(engine_hex))
        assert peer.pid == child.pid
        here = mori.IOEngine("consumer:parent", mori.IOEngineConfig("127.0.0.1", 0))
        here.create_backend(mori.BackendType.RDMA, mori.RdmaBackendConfig(1, -1, 1))
        here.register_remote_engine(peer)
        dst = torch.zeros(256, dtype=torch.float32)
        session = here.create_session(
            here.register_torch_tensor(dst), mori.MemoryDesc.unpack(bytes.fromhex(region_hex))
        )
        assert _wait(session.batch_read([0], [100 * 4], [16 * 4], 1)).Succeeded()
        assert dst[:16].tolist() == [float(i) for i in range(100, 116)]
        dst[:4] = -1.0
        assert _wait(session.write(0, 0, 4 * 4, 2)).Succeeded()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[-1.0, -1.0, -1.0, -1.0, 4.0, 5.0, 6.0, 7.0]"
        here.close()
    finally:
        child.kill()
        child.wait()
