"""Generated stubs of proto package pdserve.v1 (do not edit; see protos/generate.py)."""
