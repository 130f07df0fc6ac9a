"""The results of a request file: written exactly once across kills and read back (writer.py),
and a file answered in parts by separate runs, then merged (parts.py)."""
