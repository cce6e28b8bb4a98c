"""Generated protobuf and gRPC code (proto/specmesh/v1). Do not edit."""
