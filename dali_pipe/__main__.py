"""`python -m dali_pipe COMMAND ...`: the data commands (see dali_pipe/cli/commands.py)."""
import sys

from .cli import as_a_command, cli
from .cli.commands import main

if __name__ == "__main__":
    as_a_command()
    sys.exit(cli(main))
