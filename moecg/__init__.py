"""moecg: CUDA-graph capture strategies for Mixture-of-Experts LLM decoding."""
__version__ = "0.1.0"
