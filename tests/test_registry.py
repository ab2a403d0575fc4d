"""The Redis registry, against a real redis-server (EmbeddedRedis)."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from detserve.numerics import LaneNumerics
from services.kv_handle import KVHandle
from services.redis_server import LISTEN_PORTS, EmbeddedRedis, free_port
from services.registry import (
    DecoderRecord,
    Heartbeat,
    LinkRecord,
    Registry,
    VerifierRecord,
)

NUMERICS = LaneNumerics(verify_window=8, verify_group=4)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as r:
        yield r


@pytest.fixture
def registry(server: EmbeddedRedis) -> Iterator[Registry]:
    reg = Registry(server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    yield reg
    reg.close()


def _record(decoder_id: str, epoch: int) -> DecoderRecord:
    handle = KVHandle("shm", f"seg-{epoch}", (3, 2, 8, 16, 2, 8), "float32", "cpu", epoch,
                      decoder_id)
    return DecoderRecord(decoder_id, epoch, handle, "ab" * 32, NUMERICS, "torch-ref-1/x")


def test_embedded_redis_is_a_real_server() -> None:
    with EmbeddedRedis() as r:
        client = redis.Redis.from_url(r.url)
        assert client.ping()
        assert client.info("server")["redis_version"]
        proc = r._proc
        client.close()
    assert proc is not None and proc.poll() is not None, "server stopped on exit"
    assert not r.running


def test_embedded_redis_refuses_clients_without_its_password(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The password is generated per server, travels in the URL (never on the command
    line), and a client without it, or with another, is refused; the server keeps serving
    the client that has it. A URL without a password takes REDIS_PASSWORD (Kubernetes)."""
    with EmbeddedRedis() as r, EmbeddedRedis() as other:
        assert r.password and r.password != other.password
        assert f":{r.password}@" in r.url and r.password not in r.address
        assert all(r.password not in arg for arg in r._proc.args)  # type: ignore[union-attr]
        bare = f"redis://{r.address}/0"
        for url in (bare, f"redis://:{other.password}@{r.address}/0"):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis.from_url(url, socket_timeout=5).ping()
            monkeypatch.delenv("REDIS_PASSWORD", raising=False)
            with pytest.raises(redis.AuthenticationError):
                Registry(url).ping()
        assert Registry(r.url).ping()
        monkeypatch.setenv("REDIS_PASSWORD", r.password)
        assert Registry(bare).ping()


def test_free_ports_are_picked_outside_the_ephemeral_range_and_bind() -> None:
    """Ports for servers started later (Redis, Ray Serve's ingress) come from below the
    range outbound connections take their local ports from, and are free: a server binds
    each. A port something listens on is never handed out."""
    lo, hi = LISTEN_PORTS
    with socket.socket() as taken:
        busy = free_port()
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        ports = {free_port() for _ in range(50)}
        assert busy not in ports
    assert all(lo <= p <= hi for p in ports) and len(ports) > 40
    for p in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_epochs_and_decoder_records(registry: Registry) -> None:
    assert registry.current_epoch("d0") is None
    e1 = registry.next_epoch("d0")
    registry.publish_decoder(_record("d0", e1))
    got = registry.get_decoder("d0")
    assert got == _record("d0", e1)
    e2 = registry.next_epoch("d0")  # the decoder restarted
    assert e2 == e1 + 1 and registry.current_epoch("d0") == e2
    with pytest.raises(ValueError, match="not current"):
        registry.publish_decoder(_record("d0", e1))
    registry.publish_decoder(_record("d0", e2))
    assert not registry.retire_decoder("d0", e1), "an old epoch cannot retire the new one"
    assert registry.get_decoder("d0") == _record("d0", e2)
    assert registry.retire_decoder("d0", e2)
    assert registry.get_decoder("d0") is None
    assert registry.current_epoch("d0") == e2, "the epoch counter never goes back"


def test_block_tables(registry: Registry) -> None:
    epoch = registry.next_epoch("d1")
    registry.update_block_tables("d1", epoch, {"r1": [3, 4], "r2": (7,)})
    registry.update_block_tables("d1", epoch, {"r1": [3, 4, 9]})
    assert registry.block_tables("d1", epoch) == {"r1": [3, 4, 9], "r2": [7]}
    registry.update_block_tables("d1", epoch, {"r2": None})
    assert registry.block_tables("d1", epoch) == {"r1": [3, 4, 9]}
    registry.update_block_tables("d1", epoch, {"r1": None, "r3": (5,), "r4": [6, 2]})
    assert registry.block_tables("d1", epoch) == {"r3": [5], "r4": [6, 2]}
    registry.update_block_tables("d1", epoch, {"r3": None})
    assert registry.block_tables("d1", epoch) == {"r4": [6, 2]}
    registry.publish_decoder(_record("d1", epoch))
    registry.retire_decoder("d1", epoch)
    assert registry.block_tables("d1", epoch) == {}


def test_verifier_registration_expires_without_heartbeat(registry: Registry) -> None:
    a = VerifierRecord("va", "127.0.0.1:1", "h", "cpu", "w")
    b = VerifierRecord("vb", "127.0.0.1:2", "h", "cpu", "w")
    registry.register(a, ttl_s=0.3)
    beat = Heartbeat(registry, b, ttl_s=0.3).start()
    try:
        assert registry.live_verifiers() == [a, b]
        time.sleep(0.6)
        assert registry.live_verifiers() == [b], "a's TTL ran out; b's heartbeat renewed it"
        assert beat.registered
    finally:
        beat.stop(deregister=True)
    assert registry.live_verifiers() == []
    assert not beat.alive


def test_link_records_are_kept_apart_from_verifiers_and_expire(registry: Registry) -> None:
    link = LinkRecord("replica-1", "127.0.0.1:3")
    verifier = VerifierRecord("vc", "127.0.0.1:4", "h", "cpu", "w")
    beat = Heartbeat(registry, link, ttl_s=0.3).start()
    registry.register(verifier, ttl_s=0.3)
    try:
        assert registry.live_links() == [link]
        assert registry.live_verifiers() == [verifier]
        time.sleep(0.6)
        assert registry.live_links() == [link], "the heartbeat renews the link's TTL"
        assert registry.live_verifiers() == []
    finally:
        beat.stop(deregister=True)
    assert registry.live_links() == []


def test_restore_decoder_keeps_epochs_monotonic(registry: Registry) -> None:
    """A decoder re-publishes its epoch and record into a Redis that lost them; the counter
    is raised to the decoder's epoch, never lowered, and a newer epoch makes it stale."""
    for _ in range(3):
        epoch = registry.next_epoch("d2")
    record = _record("d2", epoch)
    registry.publish_decoder(record)
    registry.r.delete(registry.epoch_key("d2"), registry.decoder_key("d2"))  # data lost
    registry.r.set(registry.epoch_key("d2"), 1)  # a counter started again from nothing
    assert registry.restore_decoder(record)
    assert registry.current_epoch("d2") == epoch and registry.get_decoder("d2") == record
    assert registry.next_epoch("d2") == epoch + 1, "the next epoch is above every one seen"
    assert not registry.restore_decoder(record), "a newer epoch: the old one is stale"
    assert registry.current_epoch("d2") == epoch + 1, "a stale restore writes nothing"
    # a decoder (re)started while the counter is gone starts above every earlier epoch
    registry.r.delete(registry.epoch_key("d2"))
    assert registry.next_epoch("d2") > epoch + 1


def test_heartbeats_write_their_records_again_after_redis_lost_its_data() -> None:
    """A supervised embedded Redis killed comes back on the same URL, empty, within a
    second; the heartbeats (decoder, verifier, link) write their records again within a
    third of their TTL of its return, and a reader sees a new ``instance``."""
    ttl = 0.6
    with EmbeddedRedis() as server:
        server.supervise(poll_s=0.1)
        reg = Registry(server.url, prefix="lost")
        decoder = _record("d3", reg.next_epoch("d3"))
        reg.publish_decoder(decoder)
        link = LinkRecord("replica-2", "127.0.0.1:5")
        verifier = VerifierRecord("vd", "127.0.0.1:6", "h", "cpu", "w")
        beats = [Heartbeat(reg, r, ttl_s=ttl).start() for r in (decoder, link, verifier)]
        try:
            before = reg.instance()
            pid, url = server.pid, server.url
            assert pid is not None
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while server.restarts < 1:
                assert time.monotonic() - t0 < 5, "the supervisor did not restart Redis"
                time.sleep(0.02)
            restarted = time.monotonic() - t0
            assert server.url == url and server.pid != pid and server.running
            assert restarted < 2.0, f"restarted after {restarted:.2f} s"
            while not (reg.live_links() and reg.live_verifiers() and reg.get_decoder("d3")):
                assert time.monotonic() - t0 < restarted + ttl, "records not written again"
                time.sleep(0.02)
            assert reg.live_links() == [link] and reg.live_verifiers() == [verifier]
            assert reg.get_decoder("d3") == decoder
            assert reg.current_epoch("d3") == decoder.epoch
            assert reg.instance() != before, "a reader can tell that Redis lost its data"
            assert all(b.alive and not b.stale for b in beats)
        finally:
            for b in beats:
                b.stop(deregister=True)
            reg.close()
    assert not server.running and server.restarts == 1, "stop() ends the supervisor too"
