"""The OpenAI-compatible HTTP front end (see app.py)."""
