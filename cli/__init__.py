"""The ``exl3tools`` command line: thin glue over the library, one command per module.

Commands are imported lazily so that ``exl3tools inspect`` never pays for torch or the server.
To add a command: write ``cli/<name>.py`` exposing a click command and add one row to COMMANDS.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from exl3tools import __version__

# command name -> (module, attribute). Keep sorted by workflow order.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("exl3tools.cli.inspect", "inspect_cmd"),
    "validate": ("exl3tools.cli.validate", "validate_cmd"),
    "dequantize": ("exl3tools.cli.dequantize", "dequantize_cmd"),
    "normalize": ("exl3tools.cli.normalize", "normalize_cmd"),
    "rank-slice": ("exl3tools.cli.rank_slice", "rank_slice_cmd"),
    "verify": ("exl3tools.cli.verify", "verify_cmd"),
    "plan": ("exl3tools.cli.plan", "plan_cmd"),
    "diff": ("exl3tools.cli.diff", "diff_cmd"),
    "eval": ("exl3tools.cli.eval", "eval_cmd"),
    "generate": ("exl3tools.cli.generate", "generate_cmd"),
    "serve": ("exl3tools.cli.serve", "serve_cmd"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a command not built yet in this checkout
            if exc.name == module:
                return None
            raise
        return getattr(mod, attr)

    def invoke(self, ctx: click.Context):  # one place turns errors into one line + exit code
        from exl3tools.cli._errors import EXIT_INTERRUPTED, EXIT_STDOUT_CLOSED, classify
        from exl3tools.cli._output import StdoutClosed

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except StdoutClosed:  # not an error to report: the reader has all it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
            sys.exit(EXIT_STDOUT_CLOSED)
        except BaseException as exc:
            if isinstance(exc, SystemExit) or _debug(ctx):
                raise
            known = classify(exc)
            if known is None:
                click.echo(f"internal error: {type(exc).__name__}: {exc} "
                           "(rerun with --debug for a traceback)", err=True)
                sys.exit(70)
            code, message = known
            click.echo(f"error: {message}", err=True)
            sys.exit(code)


def _debug(ctx: click.Context) -> bool:
    root = ctx.find_root()
    return bool((root.obj or {}).get("debug")) or os.environ.get("EXL3TOOLS_DEBUG") == "1"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"],
                                              "auto_envvar_prefix": "EXL3TOOLS"})
@click.version_option(__version__, prog_name="exl3tools")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Inspect, validate, normalize, rank-slice and serve EXL3 checkpoints."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
