"""The network front ends (gRPC service and its lifecycle, codec, errors, auth) and metrics/logs."""
