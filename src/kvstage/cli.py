"""The `kvstage` command line: `demo`, `sim`, `bench` and `serve`.

Owns argument parsing and nothing else; each command imports its implementation lazily so that
`kvstage --help` stays fast and a missing optional transport never breaks unrelated commands.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="kvstage",
    help="Hand the KV cache from prefill to decode workers across different TP sizes, through a staging ring.",
    no_args_is_help=True,
    add_completion=False,
)


def main() -> None:
    app()
