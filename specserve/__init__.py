"""specserve: EAGLE speculative decoding on an overlap scheduler, served over gRPC."""
__version__ = "0.1.0"
