"""Namespace of the pdserve protos; see protos/__init__.py."""
