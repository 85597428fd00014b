"""`python -m dali_pipe COMMAND ...`: the data commands (see dali_pipe/cli/commands.py)."""
import gc
import sys

if __name__ == "__main__":
    gc.disable()  # while the command's modules load; as_a_command() freezes what they made, then turns it on
    try:
        from .cli import as_a_command, cli  # lazy: loaded with the collector off (see above)
        from .cli.commands import main  # lazy: as above
    except KeyboardInterrupt:  # Ctrl-C before the CLI's handlers are in place: its words and status, no traceback
        print("stopped by Ctrl-C", file=sys.stderr)
        sys.exit(130)
    except BaseException:  # a process that outlives a failed import here (python -i, pdb, runpy) keeps its collector
        gc.enable()
        raise
    as_a_command()
    sys.exit(cli(main))
