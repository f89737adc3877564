"""The gRPC front: the GenerationService servicer and server reflection."""
