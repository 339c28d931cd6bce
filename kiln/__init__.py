"""kiln: a PyTorch-native training engine that reads and writes HuggingFace formats bit-exactly."""

__version__ = "0.1.0"
