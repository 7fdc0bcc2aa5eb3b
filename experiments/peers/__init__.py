"""kernjax's peers in the prefill benchmark: the same model and prompt run by other code.

Each keeps the system contract of `experiments/systems.py`: `plain_jax` (a plain JAX Qwen3 in one
pass, attention by cuDNN) and `transformers` (Hugging Face's `Qwen3ForCausalLM` on torch).
"""
