"""Other ecosystems' formats.

- hf.py: Hugging Face Llama/Mixtral configs and safetensors in and out, SHA256SUMS.
- quantize.py: per-channel INT8 weights and their export format.
"""
