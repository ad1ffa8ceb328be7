"""pdserve's protocol: the .proto files (package pdserve.v1) and their generated stubs.

Import stubs as `from pdserve.protos.pdserve.v1 import decode_pb2, decode_pb2_grpc`; regenerate
them with `python -m pdserve.protos.generate`.
"""
