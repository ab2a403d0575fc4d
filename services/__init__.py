"""The serving cluster: router, decoder and verifier services (Ray Serve + gRPC + Redis)."""
