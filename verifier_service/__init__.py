"""Verifier service: gRPC server and tensor-parallel worker loop around the specmesh engine."""
