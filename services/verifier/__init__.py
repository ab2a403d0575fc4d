"""The verifier pool: lane executors that decoders reach over a bidirectional gRPC stream.

- ``server``: the gRPC servicer (maps a decoder's KV pool, runs its lane passes);
- ``replica``: one verifier process (model + server + Redis registration);
- ``deployment``: the Ray Serve deployment ``Verifier`` around a replica;
- ``client``: ``RemoteVerifier``, the decoder's side, and ``make_verifier_factory``;
- ``stream``, ``codec``: one gRPC stream; protobuf <-> lane messages;
- ``verifier_pb2*``: generated from ``proto/verifier.proto`` by ``proto/gen.py``.
"""
