"""The command line: the Typer app and its commands (run, serve, pull, bench, ...); the only
place errors are printed."""
