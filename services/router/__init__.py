"""Router: the OpenAI-compatible HTTP API and the gRPC ``Completions`` service.

Requests are validated (``schemas``, ``prepare``, ``limits``), admitted or shed
(``admission``), sent over the link of a decoder replica chosen by ``links`` (least
outstanding tokens, prefix affinity for deterministic requests) and streamed back
(``dispatch``, ``openai_format``, ``grpc_api``). ``metrics`` serves Prometheus text.
"""
