"""Generated protobuf and gRPC code (tools/gen_protos.py; do not edit)."""
