"""Generated gRPC stubs for async_engine.v1 (`make proto`), and fields.py (hand-written): where
a sampling setting lives in their messages. Only server and client import them."""
