"""pdserve: disaggregated prefill/decode LLM serving. This package holds the `pdserve`
command line and the Python client; the tiers live in their own top-level packages."""

__version__ = "0.1.0"
