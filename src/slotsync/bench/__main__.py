"""``python -m slotsync.bench``: see ``slotsync.bench.cli``."""

from slotsync.bench.cli import main

if __name__ == "__main__":
    main()
