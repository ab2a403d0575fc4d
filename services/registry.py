"""Who is where: decoders' KV pools and block tables, and the live verifiers, in Redis.

Keys (``<p>`` is the prefix, ``detserve`` by default):

- ``<p>:epoch:<decoder_id>``: integer, INCR'd by a decoder at every start (the first one
  sets it to the clock in microseconds). The value is the decoder's current epoch; a
  handle or hello with a smaller epoch is stale.
- ``<p>:decoder:<decoder_id>``: JSON ``DecoderRecord`` of the current epoch (KV handle,
  weights hash, ``LaneNumerics``, kernel set). Written once the pool exists, deleted when the
  decoder shuts down cleanly (only if still its epoch).
- ``<p>:blocks:<decoder_id>:<epoch>``: hash ``request_id -> JSON list of block ids`` of the
  decoder's deterministic requests, updated when a request's table changes, the field
  deleted when it finishes, the whole hash deleted with the decoder record.
- ``<p>:verifier:<verifier_id>``: JSON ``VerifierRecord`` (gRPC address, host, model), with
  a TTL that the verifier's heartbeat keeps refreshing: a verifier that dies disappears
  within one TTL without anyone deregistering it.
- ``<p>:link:<replica_id>``: JSON ``LinkRecord`` (the decoder replica's link address), with
  a TTL kept alive by the decoder's heartbeat: routers find decoders' links here
  (``services.decoder.link``).
- ``<p>:instance``: a random id set by the first reader that finds none: a new value means
  Redis lost its data (restarted empty) since the reader last looked.

Redis may go away and come back empty (the embedded server restarted by its supervisor, a
StatefulSet pod rescheduled). Every record is therefore re-written by the process that owns
it, by a ``Heartbeat``: verifiers and links re-register within a third of their TTL, and a
decoder restores its epoch and record (``restore_decoder``). The epoch counter stays
monotonic: a restore raises it back to the decoder's epoch and never lowers it, a counter
started afresh starts at the clock (``next_epoch``), and a decoder that finds a newer epoch
of its id is stale and stops.

Nothing here lets a reader talk to a server: links and verifiers ask for the cluster secret
(``services.cluster_auth``), which is never written to Redis. The Redis URL carries the
server's password (``redis://:PASSWORD@host:port/db``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import redis

from detserve.config import SamplerConfig
from detserve.numerics import LaneNumerics
from services.kv_handle import KVHandle

DEFAULT_PREFIX = "detserve"
# a Redis URL without a password takes this variable's value (Kubernetes: from the Secret
# detserve-redis), so the password need not be written into the serve config
PASSWORD_ENV = "REDIS_PASSWORD"
_RETIRE = """
local v = redis.call('GET', KEYS[1])
if v and cjson.decode(v)['epoch'] == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
redis.call('DEL', KEYS[2])
return 0
"""
# KEYS: epoch; ARGV: where a missing counter starts
_NEXT_EPOCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCR', KEYS[1])
end
redis.call('SET', KEYS[1], ARGV[1])
return tonumber(ARGV[1])
"""
# KEYS: epoch, record; ARGV: epoch, record JSON. 0: a newer epoch is current (stale)
_RESTORE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local epoch = tonumber(ARGV[1])
if current > epoch then
  return 0
end
if current < epoch then
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('SET', KEYS[2], ARGV[2], 'NX')
return 1
"""


def numerics_from_dict(d: Mapping[str, object]) -> LaneNumerics:
    """``LaneNumerics`` from its ``asdict`` (JSON) form."""
    sampling = d.get("sampling", {})
    if not isinstance(sampling, Mapping):
        raise ValueError(f"bad sampling config {sampling!r}")
    return LaneNumerics(**{**d, "sampling": SamplerConfig(**sampling)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class DecoderRecord:
    decoder_id: str
    epoch: int
    kv_handle: KVHandle
    weights_hash: str
    numerics: LaneNumerics  # what the verifier's runner is built from
    kernels: str            # codec.kernels_profile of the decoder's runner

    def to_json(self) -> str:
        d = asdict(self)
        d["kv_handle"] = self.kv_handle.to_json()
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DecoderRecord:
        d = json.loads(text)
        d["kv_handle"] = KVHandle.from_json(d["kv_handle"])
        d["numerics"] = numerics_from_dict(d["numerics"])
        return cls(**d)


@dataclass(frozen=True)
class VerifierRecord:
    verifier_id: str
    address: str            # host:port of its gRPC server
    host: str               # host id: co-location with a decoder's KV pool
    device: str
    weights_hash: str
    device_key: str = ""    # "cpu" or the GPU's UUID: the same as a pool's -> it can map it
    kv_store: str = ""      # host:port of the store its K/V transfer groups meet in
    load: int = 0           # decoders it verifies for now (refreshed with the heartbeat)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> VerifierRecord:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class LinkRecord:
    """A decoder replica's link server (``services.decoder.link``): routers submit requests
    and read chunks there."""

    replica: str
    address: str            # host:port

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LinkRecord:
        return cls(**json.loads(text))


Record = VerifierRecord | LinkRecord | DecoderRecord


class Registry:
    """Thin typed layer over redis-py; safe to share between threads."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.url = url
        self.prefix = prefix
        password = None if urlsplit(url).password else os.environ.get(PASSWORD_ENV) or None
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5.0,
                                      socket_connect_timeout=5.0, health_check_interval=10,
                                      password=password)
        self._retire = self.r.register_script(_RETIRE)
        self._restore = self.r.register_script(_RESTORE)
        self._next_epoch = self.r.register_script(_NEXT_EPOCH)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()

    # ---- keys -----------------------------------------------------------------------
    def epoch_key(self, decoder_id: str) -> str:
        return f"{self.prefix}:epoch:{decoder_id}"

    def decoder_key(self, decoder_id: str) -> str:
        return f"{self.prefix}:decoder:{decoder_id}"

    def blocks_key(self, decoder_id: str, epoch: int) -> str:
        return f"{self.prefix}:blocks:{decoder_id}:{epoch}"

    def verifier_key(self, verifier_id: str) -> str:
        return f"{self.prefix}:verifier:{verifier_id}"

    def link_key(self, replica: str) -> str:
        return f"{self.prefix}:link:{replica}"

    def key_of(self, record: VerifierRecord | LinkRecord) -> str:
        if isinstance(record, VerifierRecord):
            return self.verifier_key(record.verifier_id)
        return self.link_key(record.replica)

    def instance(self) -> str:
        """This Redis's data generation: changes when Redis restarts empty."""
        key = f"{self.prefix}:instance"
        self.r.set(key, os.urandom(8).hex(), nx=True)
        return _text(self.r.get(key) or "")

    # ---- decoders -------------------------------------------------------------------
    def next_epoch(self, decoder_id: str) -> int:
        """Start a new epoch for ``decoder_id``: every earlier handle becomes stale. The
        counter is incremented; where there is none (the first start, or a Redis that lost
        its data) it starts at the wall clock in microseconds, above any epoch this id had
        before the loss (restarts are far rarer than one a microsecond)."""
        floor = time.time_ns() // 1000
        return int(self._next_epoch(keys=[self.epoch_key(decoder_id)], args=[floor]))

    def current_epoch(self, decoder_id: str) -> int | None:
        v = self.r.get(self.epoch_key(decoder_id))
        return None if v is None else int(v)

    def publish_decoder(self, record: DecoderRecord) -> None:
        if record.kv_handle.epoch != record.epoch or record.kv_handle.decoder_id != record.decoder_id:
            raise ValueError("the KV handle belongs to another decoder or epoch")
        current = self.current_epoch(record.decoder_id)
        if current != record.epoch:
            raise ValueError(f"epoch {record.epoch} of {record.decoder_id} is not current "
                             f"({current}); call next_epoch first")
        self.r.set(self.decoder_key(record.decoder_id), record.to_json())

    def get_decoder(self, decoder_id: str) -> DecoderRecord | None:
        v = self.r.get(self.decoder_key(decoder_id))
        return None if v is None else DecoderRecord.from_json(_text(v))

    def restore_decoder(self, record: DecoderRecord) -> bool:
        """Re-publish ``record`` after Redis lost it: the epoch counter is raised to the
        record's epoch if lower (never lowered), the record written if absent. False (and
        nothing written) when a newer epoch of this decoder is current: it is stale."""
        keys = [self.epoch_key(record.decoder_id), self.decoder_key(record.decoder_id)]
        return bool(self._restore(keys=keys, args=[record.epoch, record.to_json()]))

    def retire_decoder(self, decoder_id: str, epoch: int) -> bool:
        """Delete the record (if still ``epoch``'s) and that epoch's block tables."""
        keys = [self.decoder_key(decoder_id), self.blocks_key(decoder_id, epoch)]
        return bool(self._retire(keys=keys, args=[epoch]))

    # ---- block tables -----------------------------------------------------------------
    def update_block_tables(self, decoder_id: str, epoch: int,
                            tables: Mapping[str, Sequence[int] | None]) -> None:
        """Publish the tables, drop those given as None: one round trip."""
        key = self.blocks_key(decoder_id, epoch)
        dropped = [rid for rid, t in tables.items() if t is None]
        pipe = self.r.pipeline(transaction=False)
        if len(dropped) < len(tables):
            pipe.hset(key, mapping={rid: json.dumps(list(t)) for rid, t in tables.items()
                                    if t is not None})
        if dropped:
            pipe.hdel(key, *dropped)
        pipe.execute()

    def block_tables(self, decoder_id: str, epoch: int) -> dict[str, list[int]]:
        raw = self.r.hgetall(self.blocks_key(decoder_id, epoch))
        return {_text(rid): json.loads(v) for rid, v in raw.items()}

    # ---- verifiers and decoder links (records with a TTL) ------------------------------
    def register(self, record: VerifierRecord | LinkRecord, ttl_s: float) -> None:
        """(Re)register; also the heartbeat: the key expires ``ttl_s`` after the last call."""
        self.r.set(self.key_of(record), record.to_json(), px=max(1, int(ttl_s * 1000)))

    def deregister(self, record: VerifierRecord | LinkRecord) -> None:
        self.r.delete(self.key_of(record))

    def _live(self, pattern: str) -> list[str]:
        keys = sorted(self.r.scan_iter(match=pattern, count=100))
        values = self.r.mget(keys) if keys else []
        return [_text(v) for v in values if v is not None]

    def live_verifiers(self) -> list[VerifierRecord]:
        """Verifiers whose TTL has not expired, sorted by id (a stable order)."""
        return [VerifierRecord.from_json(v) for v in self._live(self.verifier_key("*"))]

    def live_links(self) -> list[LinkRecord]:
        """Decoder links whose TTL has not expired, sorted by replica id."""
        return [LinkRecord.from_json(v) for v in self._live(self.link_key("*"))]


def _text(value: str | bytes) -> str:
    # the client decodes responses; the bytes case only exists in redis-py's type hints
    return value if isinstance(value, str) else value.decode()


class Heartbeat:
    """Background thread that keeps a record in Redis (every ttl/3), and writes it again
    when Redis comes back without it: a verifier's or a link's registration (TTL ``ttl_s``),
    or a decoder's epoch and record (``restore_decoder``; no TTL). A decoder's heartbeat
    that finds a newer epoch sets ``stale`` and stops."""

    def __init__(self, registry: Registry, record: Record, ttl_s: float = 3.0,
                 update: Callable[[Record], Record] | None = None) -> None:
        """``update``: the record to write at each beat, from the last one (a verifier's
        load)."""
        self.registry = registry
        self.record = record
        self._update = update
        self.ttl_s = ttl_s
        self.stale = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat",
                                        daemon=True)
        self.last_ok = 0.0  # time.monotonic() of the last successful refresh

    def start(self, required: bool = True) -> Heartbeat:
        """Write the record and start refreshing it; ``required=False``: a Redis that does
        not answer now is no error, the record is written once it does."""
        try:
            self._refresh()
        except redis.RedisError:
            if required:
                raise
        self._thread.start()
        return self

    @property
    def registered(self) -> bool:
        """Whether the registration can still be live (refreshed within one TTL)."""
        return self.alive and time.monotonic() - self.last_ok < self.ttl_s

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def refresh(self) -> bool:
        """Write the record now (not waiting for the next beat); whether Redis took it."""
        try:
            self._refresh()
        except redis.RedisError:
            return False
        return not self.stale

    def _refresh(self) -> None:
        if self._update is not None:
            self.record = self._update(self.record)
        if isinstance(self.record, DecoderRecord):
            if not self.registry.restore_decoder(self.record):
                self.stale = True
                self._stop.set()
                return
        else:
            self.registry.register(self.record, self.ttl_s)
        self.last_ok = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._refresh()
            except redis.RedisError:
                pass  # Redis is away: retry; the record is written again once it is back

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            try:
                if isinstance(self.record, DecoderRecord):
                    self.registry.retire_decoder(self.record.decoder_id, self.record.epoch)
                else:
                    self.registry.deregister(self.record)
            except redis.RedisError:
                pass  # a TTL record expires anyway; a decoder's is replaced by its next epoch
