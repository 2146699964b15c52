"""Generated gRPC stubs for async_engine.v1 (`make proto`); only server and client import them."""
