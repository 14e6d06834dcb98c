"""Generated protobuf and gRPC code for croupier's API v1 (placeholder until the API exists)."""
