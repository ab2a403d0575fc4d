"""One bidirectional ``Verify`` call to one verifier, seen from the decoder.

Requests go out through a queue that feeds gRPC's request iterator; a reader thread puts
every reply, and finally a ``Closed`` marker, on the owner's event queue tagged with this
stream's generation, so the owner (``RemoteVerifier``) handles everything on one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from services.cluster_auth import ClusterAuth
from services.registry import VerifierRecord
from services.verifier import verifier_pb2 as pb
from services.verifier import verifier_pb2_grpc as pb_grpc

# Detect a peer that vanished without closing the connection (host down, cable pulled);
# a killed process is seen at once (connection reset). The server permits these pings.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class Closed:
    """The stream ended; ``code`` is None when the server closed it cleanly."""

    code: grpc.StatusCode | None
    details: str


Event = tuple[int, "pb.LaneReply | Closed"]


class LaneStream:
    def __init__(self, verifier: VerifierRecord, generation: int,
                 events: queue.Queue[Event], auth: ClusterAuth) -> None:
        self.verifier = verifier
        self.generation = generation
        self._events = events
        self._lock = threading.Lock()  # the reader posts while ``retarget`` swaps queues
        self._outbox: queue.Queue[pb.LaneRequest | None] = queue.Queue()
        self._channel = auth.channel(verifier.address, options=CHANNEL_OPTIONS)
        self._handshake = auth.handshake(verifier.address)
        self._call = pb_grpc.VerifierStub(self._channel).Verify(
            self._requests(), metadata=self._handshake.metadata)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"verifier-stream-{generation}")
        self._reader.start()

    def retarget(self, events: queue.Queue[Event]) -> None:
        """Post to ``events`` from now on, moving what is queued (a search's private queue
        handed over to the owner's)."""
        with self._lock:
            old, self._events = self._events, events
            while True:
                try:
                    events.put(old.get_nowait())
                except queue.Empty:
                    break

    def _post(self, event: pb.LaneReply | Closed) -> None:
        with self._lock:
            self._events.put((self.generation, event))

    def send(self, request: pb.LaneRequest) -> None:
        self._outbox.put(request)

    @property
    def open(self) -> bool:
        """Not ended yet (its reader posts ``Closed`` as it ends)."""
        return self._reader.is_alive()

    def close(self) -> None:
        """Half-close and cancel; the reader thread ends with a Closed event."""
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()

    def _requests(self) -> Iterator[pb.LaneRequest]:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        verified = False
        try:
            for reply in self._call:
                verified = verified or self._handshake.verify(self._call.initial_metadata())
                if not verified:
                    # nothing from a server that cannot prove the secret is trusted
                    self._call.cancel()
                    self._post(Closed(grpc.StatusCode.UNAUTHENTICATED,
                                      "the verifier did not prove it holds the cluster secret"))
                    return
                self._post(reply)
            self._post(Closed(None, "stream ended"))
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = e.details() if isinstance(e, grpc.Call) else str(e)
            self._post(Closed(code, details or ""))
        except Exception as e:  # the owner must always learn that this stream is gone
            self._post(Closed(grpc.StatusCode.UNKNOWN, repr(e)))
