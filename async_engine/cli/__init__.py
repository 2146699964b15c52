"""The ``async-engine`` command line: one module per subcommand, ``main`` dispatches."""
