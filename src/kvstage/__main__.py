"""`python -m kvstage`: the `kvstage` command."""

from kvstage.cli import main

main()
