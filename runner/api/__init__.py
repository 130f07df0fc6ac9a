"""The wire formats: requests in, results out (podrun's own lines and OpenAI Batch files)."""
