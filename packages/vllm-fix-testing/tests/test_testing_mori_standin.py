"""The MORI stand-in against vLLM's real MoRIIOWrapper (installed vLLM, CPU)."""

from __future__ import annotations

import pytest
import torch

from vllm_fix_testing import (
    FAILED,
    PENDING,
    SUCCEEDED,
    FakeEngine,
    FakeStatus,
    FakeWrapper,
    Notify,
    done,
    failed,
    pending,
)
from vllm_fix_testing.engine import real_wrapper_class


def _states() -> object:
    from vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common import TransferBatchState

    return TransferBatchState


def test_status_interface() -> None:
    s = pending()
    assert (s.Failed(), s.Succeeded(), s.InProgress()) == (False, False, True)
    s.succeed()
    assert (s.Failed(), s.Succeeded(), s.state) == (False, True, SUCCEEDED)
    f = failed("cq error", 12)
    assert (f.Failed(), f.Message(), f.Code(), f.state) == (True, "cq error", 12, FAILED)
    assert done().Succeeded()
    with pytest.raises(ValueError, match="unknown transfer state"):
        FakeStatus("lost")


def test_scripted_status_advances_per_poll() -> None:
    s = FakeStatus(script=[PENDING, PENDING, FAILED])
    assert [s.Failed() for _ in range(4)] == [False, False, True, True]
    assert s.Message() and s.Code() == -1
    assert s.observations == 4
    t = FakeStatus(script=[PENDING, SUCCEEDED])
    assert (t.Failed(), t.Succeeded()) == (False, False)  # one poll, one consistent state
    assert (t.Failed(), t.Succeeded()) == (False, True)


def test_fake_wrapper_uses_real_poll() -> None:
    w = FakeWrapper()
    states = _states()
    assert w.poll_transfer_batch([done(), done()]) is states.DONE  # type: ignore[attr-defined]
    assert w.poll_transfer_batch([done(), pending()]) is states.PENDING  # type: ignore[attr-defined]
    assert w.poll_transfer_batch([pending(), failed()]) is states.FAILED  # type: ignore[attr-defined]
    assert FakeWrapper.poll_transfer_batch is not real_wrapper_class().poll_transfer_batch
    assert w.lock.acquire(blocking=False)
    w.lock.release()


def test_fake_wrapper_records_notifies() -> None:
    w = FakeWrapper()
    w.send_notify("tx", "h", "7000", message_type="release", message_fields={"consumer_tp_size": 2})
    w.send_notify(["a", "b"], "h", 7001)
    assert w.sent[0] == Notify("tx", "h", "7000", "release", {"consumer_tp_size": 2})
    assert [n.transfer_id for n in w.sent[1:]] == ["a", "b"]
    assert w.releases() == [("tx", "7000")]
    w.notify_error = OSError("down")
    with pytest.raises(OSError):
        w.send_notify("tx", "h", "7000")
    w.shutdown()
    assert w.shut_down


def test_engine_behind_real_wrapper() -> None:
    """vLLM's real MoRIIOWrapper registers, builds sessions and reads through the fake engine."""
    engine = FakeEngine()
    wrapper = real_wrapper_class()(moriio_engine=engine)
    backing = torch.zeros(4096 * 3, dtype=torch.uint8)
    region = backing[128:8320]
    packed = wrapper.register_local_tensor(region)
    assert engine.registered[0].data_ptr == region.data_ptr()
    assert engine.registered[0].nbytes == 8192
    assert packed == engine.registered[0].pack()
    sess = wrapper.build_session(engine.registered[0], "remote-meta")
    status = wrapper.read_remote_data([64, 64], [0, 64], [4096, 4160], sess)
    assert status.Succeeded()
    (call,) = sess.reads
    assert (call.session, call.local_offsets, call.sizes) == (0, [0, 64], [64, 64])
    assert call.remote_offsets == [4096, 4160]
    assert engine.reads == [call]
    sess.status_factory = lambda _call: failed("remote access error", 10)
    assert wrapper.read_remote_data([1], [0], [0], sess).Failed()
    assert [c.uid for c in engine.reads] == [1, 2]


def test_mori_io_listener_reports_per_mori_behaviour() -> None:
    import socket

    from vllm_fix_testing.mori_io import RDMA, IOEngine, IOEngineConfig, installed_mori

    with installed_mori("1.2.2"):
        engine = IOEngine("new", IOEngineConfig("127.0.0.1", 0))
        engine.create_backend(RDMA)
        assert engine.get_engine_desc().port == engine.listener.getsockname()[1] != 0  # type: ignore[union-attr]
        engine.close()
    with installed_mori("0.0.1.dev20+g0000000"):
        engine = IOEngine("old", IOEngineConfig("127.0.0.1", 0))
        engine.create_backend(RDMA)
        assert engine.listener is not None and engine.get_engine_desc().port == 0  # bound, unreported
        engine.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        engine = IOEngine("clash", IOEngineConfig("127.0.0.1", taken.getsockname()[1]))
        try:
            engine.create_backend(RDMA)
        except OSError as exc:
            assert exc.strerror == "Address already in use"
        else:
            raise AssertionError("a bind on a listening port succeeded")
    IOEngine.close_all()
