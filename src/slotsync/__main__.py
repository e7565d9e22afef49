from slotsync.cli import main

main()
