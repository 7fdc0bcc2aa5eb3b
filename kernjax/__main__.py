"""`python -m kernjax VERB ...`: the same as the `kernjax` command."""

from kernjax.cli import main

main()
