"""``python -m mmstore``: the ``mmstore`` command line, for an environment whose scripts
directory is not on PATH."""

from mmstore.cli import main

if __name__ == "__main__":
    main()
