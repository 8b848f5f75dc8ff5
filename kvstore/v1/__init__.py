"""Generated protobuf and gRPC stubs of ``proto/kvstore/v1/kvstore.proto`` (regenerate with ``scripts/gen_proto.sh``)."""
