"""nanochat-spark: train and chat with your own small LLM (DGX Spark first, any CUDA GPU or CPU)."""

__version__ = "0.1.0"
