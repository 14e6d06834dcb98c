"""Generated protobuf and gRPC code for croupier's API v1 (made by scripts/gen_proto.py; do not edit)."""
