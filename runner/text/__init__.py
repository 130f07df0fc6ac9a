"""Text in and out of token ids: a checkpoint's tokenizer and chat template (tokenizer.py), and
GPT-OSS's Harmony chat format with its o200k_harmony vocabulary (harmony.py), and tools in chats:
requests' tools checked, calls read back in a template's own syntax (tools.py)."""
