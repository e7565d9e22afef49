from slotsync.daemon.main import main

main()
