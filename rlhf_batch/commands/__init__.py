"""L5, the commands: the Typer CLI, `run` (the loop over iterations) and run discovery."""
