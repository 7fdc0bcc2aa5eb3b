"""`python -m kernjax.cut ...`: the same as `kernjax cut ...` (the library is `kernjax.core.cut`)."""

if __name__ == "__main__":
    import sys

    from kernjax.cli import main
    main(["cut", *sys.argv[1:]])
