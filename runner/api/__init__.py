"""The wire formats, each owning its request lines in and its result lines out: podrun's own
(podrun.py) and OpenAI Batch (openai_batch.py); what both share (common.py: the request file's
lines, the parsed request, the answer built from its completions); and which one a file is in
(formats.py)."""
