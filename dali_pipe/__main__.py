"""`python -m dali_pipe COMMAND ...`: the data commands (see dali_pipe/cli/commands.py)."""
import gc
import sys

if __name__ == "__main__":
    gc.disable()  # while the command's modules load; as_a_command() freezes what they made, then turns it on

from .cli import as_a_command, cli  # noqa: E402
from .cli.commands import main  # noqa: E402

if __name__ == "__main__":
    as_a_command()
    sys.exit(cli(main))
