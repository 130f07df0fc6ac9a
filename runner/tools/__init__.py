"""The commands beside the job, each `python -m runner.tools.<name>` on the same configs as
runner.main: bench (fixed shapes and whole jobs), compile (AOT for a TPU topology), memory (bytes
per device from the declarations), perplexity, and convert (HF and GGUF checkpoints into podrun's)."""
