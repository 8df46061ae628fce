"""`python -m rlhf_batch` (and `torchrun -m rlhf_batch`) runs the CLI."""

from rlhf_batch.commands.cli import main

if __name__ == "__main__":  # a process vLLM spawns imports this module again: it must not rerun the CLI
    main()
