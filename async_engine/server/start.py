"""The error a server raises when it cannot start."""


class ServerStartError(RuntimeError):
    """The server could not start (a port in use, say); nothing of it is left running."""
